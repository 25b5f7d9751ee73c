"""Every URL pattern, API operation and WebSocket route against every role: anonymous, no role,
viewer, operator and admin. The URLconf and the API schema are walked, so new ones are covered.

Pages: anonymous -> login; no role -> the ask-an-admin page; viewers read; operators and admins
change things; a viewer's POST never changes anything (every row compared, nothing queued). The API
operations of tests/test_api_permissions.py for the roles it does not cover (no role, admin).

"Allowed" means the page answered what it answers when it works, against objects that exist (a
404 never passes for it): a read 200, a POST-only view's GET 405, a POST its redirect (or the
form's 400 for an empty form), and an action's POST changed its object.
"""
import re

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.apps import apps
from django.test import Client
from rest_framework.test import APIClient

from controlpanel.asgi import application
from benchmarks.models import Workload
from controlpanel.routing import websocket_urlpatterns
from deployments.gateway.models import CallerKey
from tests.conftest import run_async
from tests.factories import (BenchmarkRunFactory, DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory, StudyFactory,
                             UserFactory)
from tests.helpers import url_patterns
from tests.test_api_permissions import OPERATIONS, OPERATOR_ANSWERS, _concrete, objects  # noqa: F401 - objects: a fixture

ROLES = ["anonymous", "no role", "viewer", "operator", "admin"]
PUBLIC = {"/accounts/login/", "/healthz"}
MACHINE_READABLE = {"/metrics"}  # answers 401/403 like the API
OPERATOR_PAGES = ("/deploy/", "/edit/")  # forms that only make sense to someone who may change things
# The resource a path parameter names, by the literal path before it.
RESOURCE = {"nodes": "node", "models": "model", "deployments": "deployment", "copies": "copy", "benchmarks": "run",
            "studies": "study", "keys": "key", "workloads": "workload"}
# The action a page's `<action>` names, by the resource before its id: one that works on `world`'s object.
ACTION = {"copies": "delete", "deployments": "stop", "studies": "pause"}
# What a working page answers that is not a 200 GET, by URL name. POST-only views refuse a GET:
POST_ONLY = {"account-token", "logout", "run-cancel", "study-control", "study-apply", "copy-action", "deployment-action",
             "model-download", "model-remove", "key-create", "key-revoke", "notify-action", "workload-delete"}
# A form's POST address answers a GET (a reload, a typed URL) with a redirect to the form, for every role.
GET_REDIRECTS = {"model-add", "model-add-local"}
# An operator's empty POST: a form without its fields answers 400; everything else a 2xx or a redirect.
EMPTY_FORM = {"run-list", "study-list", "workload-list", "deployment-edit", "model-deploy", "model-download", "model-add", "model-add-local",
              "key-create"}
# Actions that need no field: an operator's empty POST does the work (a row changes).
ACTS = {"run-cancel", "study-control", "copy-action", "deployment-action", "account-token", "key-revoke",
        "workload-delete"}
# Actions on what a user owns (a caller key): `world`'s belongs to someone else, so an operator gets 403 and
# changes nothing; an admin does the work.
OWNED = {"key-revoke"}


def _page_path(regex: str, ids: dict) -> str:
    path = regex.replace("^", "").replace("$", "")
    path = re.sub(r"\(\?P<format>\\\.[^)]*\)", ".json", path)
    path = re.sub(r"\(\?P<fmt>[^)]*\)", "json", path)

    def value(match):
        before = path[: match.start()].rstrip("/").rsplit("/", 1)[-1]
        if match.group(1) in ("pk", "id"):
            return str(ids.get(RESOURCE.get(before, ""), 1))
        if match.group(1) == "action":
            return ACTION[path[: match.start()].rstrip("/").rsplit("/", 2)[-2]]
        return "x"

    path = re.sub(r"\(\?P<(\w+)>[^)]*\)", value, path)
    return "/" + path.replace("\\.", ".").replace("\\", "").lstrip("/")


PAGES = {r: name for r, name in url_patterns()
         if not r.startswith(("static/", "api/", "admin/")) and "(?P<format>" not in r}
PAGE_REGEXES = sorted(PAGES)


@pytest.fixture
def world(db, sent_tasks):
    node = NodeFactory(name="n1")
    GpuFactory(node=node, index=0)
    copy = ModelCopyFactory(node=node, path="/models/org/m")
    d = DeploymentFactory(node=node, model=copy.model, status="ready")
    run = BenchmarkRunFactory(deployment=d)  # queued: it may be cancelled
    study = StudyFactory(deployment=d)  # queued: it may be paused
    spare = ModelCopyFactory(node=node, path="/models/org/spare")  # no deployment uses it: it may be deleted
    key = CallerKey.objects.create(owner=UserFactory(role="operator"), name="theirs", prefix="vcp-world", digest="e" * 64)
    workload = Workload.objects.create(name="role-matrix chats", kind="multiturn", spec={"kind": "multiturn", "turns": 2})  # no run uses it: it may be deleted
    ids = {"key": key.pk, "workload": workload.pk, "node": node.pk, "model": copy.model.pk, "copy": spare.pk, "deployment": d.pk, "run": run.pk, "study": study.pk,
           "nodes": "n1", "models": copy.model.pk, "copies": spare.pk, "deployments": d.pk, "runs": run.pk,
           "studies": study.pk}
    return ids, sent_tasks


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
    """Every row of the panel's own tables, by model (so that a changed field shows, not only a count)."""
    return {m.__name__: sorted(map(repr, m.objects.values())) for m in apps.get_models()
            if m._meta.app_label in ("deployments", "benchmarks", "authtoken", "gateway", "notify")}


def test_the_matrix_covers_every_page():
    assert len(PAGE_REGEXES) >= 25 and any("unit" in r for r in PAGE_REGEXES)
    assert POST_ONLY | GET_REDIRECTS | EMPTY_FORM | ACTS | OWNED <= set(PAGES.values())  # no stale name


def _allowed_get(name: str) -> int:
    return 405 if name in POST_ONLY else 302 if name in GET_REDIRECTS else 200


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("regex", PAGE_REGEXES)
def test_every_page_for_every_role(world, regex, role):
    ids, sent = world
    path = _page_path(regex, ids)
    client = _client(role)
    name = PAGES[regex]
    public = path in PUBLIC or (path.startswith("/accounts/") and role != "anonymous")  # logging out needs a login
    got = client.get(path)
    if public:
        assert got.status_code == _allowed_get(name), f"GET {path} as {role}: {got.status_code}"
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
        assert got.status_code == _allowed_get(name), f"GET {path} as {role}: {got.status_code}"

    before = _rows()
    posted = client.post(path, {})
    assert posted.status_code != 500, f"POST {path} as {role}"
    if role in ("anonymous", "no role", "viewer") and path != "/account/token/" and not public:
        # Whatever the answer, nothing changed and nothing was queued.
        assert _rows() == before and not sent, f"POST {path} as {role} changed something"
    if role == "operator" and name in OWNED:
        assert posted.status_code == 403 and _rows() == before, f"POST {path} as {role}: {posted.status_code}"
    elif role in ("operator", "admin") and not public and path not in MACHINE_READABLE:
        if name in EMPTY_FORM:
            assert posted.status_code == 400, f"POST {path} as {role}: {posted.status_code}"
        else:
            assert 200 <= posted.status_code < 400, f"POST {path} as {role}: {posted.status_code}"
        if name in ACTS:
            assert _rows() != before, f"POST {path} as {role} answered {posted.status_code} and changed nothing"


@pytest.mark.django_db
@pytest.mark.parametrize("method, path", OPERATIONS)
def test_every_api_operation_refuses_a_user_without_a_role(world, method, path):
    ids, sent = world
    client = APIClient()
    client.force_authenticate(_user("no role"))
    response = client.generic(method, _concrete(path, ids), "{}", content_type="application/json")
    assert response.status_code == 403, f"{method} {path}: {response.status_code}"
    assert not sent


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_every_api_operation_is_open_to_an_admin(objects, method, path):  # noqa: F811 - objects: the fixture
    client = APIClient()
    client.force_authenticate(_user("admin"))
    response = client.generic(method, _concrete(path, objects), "{}", content_type="application/json")
    # An admin gets what an operator gets (tests/test_api_permissions.py): every read, and each change's own answer.
    status, code = (400 if path == "/api/models/{id}/fit/" else 200, None) if method == "GET" else OPERATOR_ANSWERS[method, path]
    assert response.status_code == status, f"{method} {path}: {response.status_code} {response.content[:300]}"
    if code:
        assert response.json()["error"]["code"] == code


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
        connected, code = await ws.connect(timeout=30)
        if allowed is True:
            assert connected
            await ws.disconnect()
        else:
            assert not connected and code == allowed
    run_async(scenario())
