"""Model pages: adding, downloading, the free-disk-space-first panel, and the write-only HF token."""
from unittest import mock

import pytest

from deployments.models import ModelRepo
from tests.deployments.test_model_services import GiB, _inspected
from tests.factories import ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_hub(sent_tasks):
    """The Hub's answer for every repo, and the queue recorded."""
    with mock.patch("deployments.host.hub.repo_check", autospec=True, return_value="0" * 40):
        yield


def test_an_operator_adds_a_repo_and_lands_on_its_page(operator_client):
    response = operator_client.post("/models/add/", {"repo_id": "zai-org/GLM-5", "revision": ""})
    model = ModelRepo.objects.get(repo_id="zai-org/GLM-5")
    assert response.status_code == 302 and response["Location"] == f"/models/{model.pk}/"
    assert "Reading the repository" in operator_client.get(response["Location"]).content.decode()


def test_a_bad_repo_id_is_shown_on_the_form(operator_client):
    response = operator_client.post("/models/add/", {"repo_id": "org/name`id`"})
    assert response.status_code == 400
    assert "A Hugging Face repo id looks like org/name" in response.content.decode()
    assert not ModelRepo.objects.exists()


def test_a_viewer_sees_no_forms_and_cannot_post(viewer_client):
    assert 'id="add-model"' not in viewer_client.get("/models/").content.decode()
    assert viewer_client.post("/models/add/", {"repo_id": "a/b"}).status_code == 403


def test_a_short_disk_shows_the_figures_and_delete_buttons(operator_client):
    model = _inspected()
    node = NodeFactory(disk_total=20 * GiB, disk_free=2 * GiB)
    other = ModelCopyFactory(node=node, bytes_done=12 * GiB)
    response = operator_client.post(f"/models/{model.pk}/download/", {"node": node.pk})
    page = response.content.decode()
    assert response.status_code == 409
    assert "needs 10.0 GiB, has 2.0 GiB free. Free disk space first." in page
    assert f"/copies/{other.pk}/delete/" in page


def test_the_model_page_shows_what_the_config_says(viewer_client):
    model = _inspected()
    page = viewer_client.get(f"/models/{model.pk}/").content.decode()
    assert "DeepseekV3ForCausalLM" in page and "MLA (KV rank 512)" in page and "256 routed, 1 shared, 8 per token" in page


def test_the_hf_token_is_write_only(operator_client, viewer):
    from django.test import Client

    viewer_client = Client()
    viewer_client.force_login(viewer)
    operator_client.post("/settings/", {"hf_token": "hf_abcdefSECRET"})
    page = operator_client.get("/settings/").content.decode()
    assert "hf_abcdefSECRET" not in page and 'id="hf-token-state">set<' in page
    assert viewer_client.post("/settings/", {"clear": "on"}).status_code == 403
    operator_client.post("/settings/", {"clear": "on"})
    assert 'id="hf-token-state">not set<' in operator_client.get("/settings/").content.decode()
