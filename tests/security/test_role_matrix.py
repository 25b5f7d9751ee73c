"""Every URL pattern, API operation and WebSocket route against every role: anonymous, no role,
viewer, operator and admin. The URLconf and the API schema are walked, so new ones are covered.

Pages: anonymous -> login; no role -> the ask-an-admin page; viewers read; operators and admins
change things; a viewer's POST never changes anything (rows counted, nothing queued). The API
operations of tests/test_api_permissions.py for the roles it does not cover (no role, admin).
"""
import re
from unittest import mock

import pytest
from asgiref.sync import sync_to_async
from celery.app.task import Task
from channels.testing import WebsocketCommunicator
from django.apps import apps
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from controlpanel.asgi import application
from controlpanel.routing import websocket_urlpatterns
from tests.conftest import run_async
from tests.factories import BenchmarkRunFactory, DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory, UserFactory
from tests.test_api_permissions import OPERATIONS, _concrete

ROLES = ["anonymous", "no role", "viewer", "operator", "admin"]
PUBLIC = {"/accounts/login/", "/healthz"}
MACHINE_READABLE = {"/metrics"}  # answers 401/403 like the API
OPERATOR_PAGES = ("/deploy/", "/edit/")  # forms that only make sense to someone who may change things
# The resource a path parameter names, by the literal path before it.
RESOURCE = {"nodes": "node", "models": "model", "deployments": "deployment", "copies": "copy", "benchmarks": "run"}


def _walk(patterns, prefix=""):
    for entry in patterns:
        regex = prefix + entry.pattern.regex.pattern.lstrip("^").rstrip("$").replace("\\Z", "")
        if isinstance(entry, URLResolver):
            yield from _walk(entry.url_patterns, regex)
        elif isinstance(entry, URLPattern):
            yield regex


def _page_path(regex: str, ids: dict) -> str:
    path = regex.replace("^", "").replace("$", "")
    path = re.sub(r"\(\?P<format>\\\.[^)]*\)", ".json", path)
    path = re.sub(r"\(\?P<fmt>[^)]*\)", "json", path)

    def value(match):
        before = path[: match.start()].rstrip("/").rsplit("/", 1)[-1]
        if match.group(1) in ("pk", "id"):
            return str(ids.get(RESOURCE.get(before, ""), 1))
        return "x"

    path = re.sub(r"\(\?P<(\w+)>[^)]*\)", value, path)
    return "/" + path.replace("\\.", ".").replace("\\", "").lstrip("/")


PAGE_REGEXES = sorted({r for r in _walk(get_resolver().url_patterns)
                       if not r.startswith(("static/", "api/", "admin/")) and "(?P<format>" not in r})


@pytest.fixture
def world(db):
    node = NodeFactory(name="n1")
    GpuFactory(node=node, index=0)
    copy = ModelCopyFactory(node=node, path="/models/org/m")
    d = DeploymentFactory(node=node, model=copy.model, status="ready")
    run = BenchmarkRunFactory(deployment=d)
    ids = {"node": node.pk, "model": copy.model.pk, "copy": copy.pk, "deployment": d.pk, "run": run.pk, "nodes": "n1",
           "models": copy.model.pk, "copies": copy.pk, "deployments": d.pk, "runs": run.pk}
    with mock.patch.object(Task, "apply_async", autospec=True) as sent:
        yield ids, sent


def _user(role):
    if role == "anonymous":
        return None
    if role == "admin":
        return UserFactory(is_superuser=True, is_staff=True)
    return UserFactory(role=None if role == "no role" else role)


def _client(role) -> Client:
    client = Client()
    user = _user(role)
    if user:
        client.force_login(user)
    return client


def _rows() -> dict:
    return {m.__name__: m.objects.count() for m in apps.get_models()
            if m._meta.app_label in ("deployments", "benchmarks", "authtoken")}


def test_the_matrix_covers_every_page():
    assert len(PAGE_REGEXES) >= 25 and any("unit" in r for r in PAGE_REGEXES)


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("regex", PAGE_REGEXES)
def test_every_page_for_every_role(world, regex, role):
    ids, sent = world
    path = _page_path(regex, ids)
    client = _client(role)
    public = path in PUBLIC or path.startswith("/accounts/")
    got = client.get(path)
    if public:
        assert got.status_code not in (401, 403, 500), path
    elif role == "anonymous":
        if path in MACHINE_READABLE:
            assert got.status_code in (401, 403)
        else:
            assert got.status_code == 302 and "/login/" in got["Location"], path
    elif role == "no role":
        assert got.status_code in (401, 403), path
        if path not in MACHINE_READABLE:
            assert "Ask an admin" in got.content.decode()
    elif role == "viewer" and path.endswith(OPERATOR_PAGES):
        assert got.status_code == 403, path
    else:
        assert got.status_code not in (401, 403, 500), f"GET {path} as {role}: {got.status_code}"

    before = _rows()
    posted = client.post(path, {})
    assert posted.status_code != 500, f"POST {path} as {role}"
    if role in ("anonymous", "no role", "viewer") and path != "/account/token/" and not public:
        # Whatever the answer, nothing changed and nothing was queued.
        assert _rows() == before and not sent.called, f"POST {path} as {role} changed something"
    if role in ("operator", "admin") and not public and path not in MACHINE_READABLE:
        assert posted.status_code not in (401, 403), f"POST {path} as {role}: {posted.status_code}"


@pytest.mark.django_db
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_every_api_operation_refuses_a_user_without_a_role(world, method, path):
    ids, sent = world
    client = APIClient()
    client.force_authenticate(_user("no role"))
    response = client.generic(method, _concrete(path, ids), "{}", content_type="application/json")
    assert response.status_code == 403, f"{method} {path}: {response.status_code}"
    assert not sent.called


@pytest.mark.django_db
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_every_api_operation_is_open_to_an_admin(world, method, path):
    ids, _ = world
    client = APIClient()
    client.force_authenticate(_user("admin"))
    response = client.generic(method, _concrete(path, ids), "{}", content_type="application/json")
    assert response.status_code not in (401, 403, 405, 500), f"{method} {path}: {response.status_code}"


WS_ROUTES = ["/" + str(p.pattern) for p in websocket_urlpatterns]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("role, allowed", [("anonymous", 4401), ("no role", 4403), ("viewer", True),
                                           ("operator", True), ("admin", True)])
@pytest.mark.parametrize("route", WS_ROUTES)
def test_every_websocket_route_for_every_role(route, role, allowed):
    async def scenario():
        client = await sync_to_async(_client)(role)
        cookie = client.cookies.get("sessionid")
        headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
        if cookie:
            headers.append((b"cookie", f"sessionid={cookie.value}".encode()))
        ws = WebsocketCommunicator(application, route, headers=headers)
        connected, code = await ws.connect()
        if allowed is True:
            assert connected
            await ws.disconnect()
        else:
            assert not connected and code == allowed
    run_async(scenario())
