"""Every URL and every WebSocket route needs a logged-in user or a token.

The URLconf is walked, so a page or endpoint added later is covered without touching this file.
"""
import re

import pytest
from channels.testing import WebsocketCommunicator

from controlpanel.asgi import application
from controlpanel.routing import websocket_urlpatterns
from tests.conftest import run_async
from tests.helpers import url_patterns

PUBLIC = {"/accounts/login/", "/healthz"}
MACHINE_READABLE = {"/metrics"}  # read by Prometheus: answers 401, like the API, instead of a login redirect


def _sample_path(regex: str) -> str:
    """Turn a URL regex into one concrete path: every named group becomes a plausible value."""
    path = regex.replace("^", "").replace("$", "").replace("\\Z", "")
    path = re.sub(r"\(\?P<format>\\\.[^)]*\)", ".json", path)
    path = re.sub(r"\(\?P<format>[^)]*\)", "json", path)
    path = re.sub(r"\(\?P<\w+>[^)]*\)", "1", path)
    path = path.replace("\\.", ".").replace("/?", "/").replace("\\", "")
    return "/" + path.lstrip("/")


ALL_PATHS = sorted({p for p in map(_sample_path, (regex for regex, _ in url_patterns())) if not p.startswith("/static/")})
GUARDED = [p for p in ALL_PATHS if p not in PUBLIC]


def test_the_walk_finds_the_pages_and_the_api():
    assert {"/", "/nodes/", "/models/", "/deployments/", "/benchmarks/", "/api/nodes/", "/admin/"} <= set(ALL_PATHS)
    assert len(GUARDED) > 20


@pytest.mark.django_db
@pytest.mark.parametrize("path", GUARDED)
def test_anonymous_users_are_turned_away_from_every_url(client, path):
    for method in ("get", "post"):
        response = getattr(client, method)(path)
        if path.startswith("/api/") or path in MACHINE_READABLE:
            assert response.status_code in (401, 403), f"{method.upper()} {path} answered {response.status_code}"
        else:
            assert response.status_code == 302, f"{method.upper()} {path} answered {response.status_code}"
            assert "/login/" in response["Location"]


@pytest.mark.django_db
def test_a_logged_in_viewer_sees_the_pages(viewer_client):
    for path in ("/", "/nodes/", "/models/", "/deployments/", "/benchmarks/", "/account/"):
        assert viewer_client.get(path).status_code == 200, path


@pytest.mark.django_db
def test_a_user_without_a_role_cannot_read_the_api(client, django_user_model):
    client.force_login(django_user_model.objects.create_user("nobody", password="x" * 12))
    assert client.get("/api/nodes/").status_code == 403


@pytest.mark.django_db
def test_an_api_token_authenticates_and_a_bad_one_does_not(client, viewer):
    from rest_framework.authtoken.models import Token

    from plumbing import tokens

    raw = tokens.issue(viewer)
    assert client.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token {raw}").status_code == 200
    # Only the digest is stored: the table's key is not a usable token.
    stored = Token.objects.get(user=viewer).key
    assert raw not in stored and client.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token {stored}").status_code == 401
    response = client.get("/api/nodes/", HTTP_AUTHORIZATION="Token not-a-token")
    assert response.status_code == 401
    assert response.json()["error"]["message"] == "Invalid token."


@pytest.mark.django_db
def test_the_account_page_shows_a_new_token_once(viewer_client):
    response = viewer_client.post("/account/token/", {"action": "create"})
    assert b'id="new-token"' in response.content
    assert b'id="new-token"' not in viewer_client.get("/account/").content


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("route", [str(p.pattern) for p in websocket_urlpatterns])
def test_every_websocket_route_refuses_anonymous_users(route):
    run_async(_refused(route))


async def _refused(route):
    communicator = WebsocketCommunicator(application, "/" + route, headers=[(b"origin", b"http://localhost"), (b"host", b"localhost")])
    connected, code = await communicator.connect(timeout=30)
    assert not connected
    assert code == 4401
    await communicator.disconnect()
