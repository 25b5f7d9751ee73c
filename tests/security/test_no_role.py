"""A logged-in user without a role sees a page saying to ask an admin, and nothing of the panel."""
import pytest
from django.test import Client

from tests.factories import DeploymentFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def no_role_client():
    client = Client()
    client.force_login(UserFactory())
    return client


def test_every_page_tells_a_user_without_a_role_to_ask_an_admin(no_role_client):
    d = DeploymentFactory(env={"NCCL_PROTO": "LL"})
    for url in ("/", "/nodes/", "/models/", f"/deployments/{d.pk}/", "/settings/", f"/deployments/{d.pk}/unit/",
                "/benchmarks/", "/account/", "/admin/"):
        response = no_role_client.get(url)
        assert response.status_code == 403, url
        assert "Ask an admin" in response.content.decode() and "ExecStart" not in response.content.decode()


def test_the_header_names_the_real_role(no_role_client, viewer_client):
    assert "no role" in no_role_client.get("/").content.decode()
    assert '<span class="badge">viewer</span>' in viewer_client.get("/").content.decode()


def test_a_user_without_a_role_can_still_log_out(no_role_client):
    assert no_role_client.post("/accounts/logout/").status_code == 302
