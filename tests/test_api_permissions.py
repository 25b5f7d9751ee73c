"""Every API endpoint against every role: anonymous gets 401, a viewer reads but cannot change,
an operator may change. The endpoints come from the schema, so new ones are covered too."""
import re

from unittest import mock

import pytest
from drf_spectacular.generators import SchemaGenerator

from benchmarks.models import BenchmarkRun, Workload
from deployments.models import Recipe
from deployments.services import recipes
from tests.helpers import api_client

pytestmark = pytest.mark.django_db
PATHS = SchemaGenerator().get_schema(request=None, public=True)["paths"]
OPERATIONS = [(method.upper(), path) for path, ops in PATHS.items() for method in ops
              if method in ("get", "post", "put", "patch", "delete") and path.startswith("/api/")]
DOCS = {"/api/schema/", "/api/docs/"}


@pytest.fixture
def objects(api_objects, operator):
    from deployments.gateway.models import CallerKey

    ids = {name: (obj.name if name == "nodes" else obj.pk) for name, obj in api_objects.items()}
    # A caller key of the operator's (operators change their own keys, admins everyone's).
    ids["keys"] = CallerKey.objects.create(owner=operator, name="team", prefix="vcp-test", digest="f" * 64).pk
    # The shipped recipes, as the list reads them in: ids are the database's own (PostgreSQL's sequences never
    # go back, so an id of 1 may be long gone).
    recipes.recipes_sync()
    ids["recipes"] = Recipe.objects.order_by("pk").values_list("pk", flat=True).first()
    ids["workloads"] = Workload.objects.create(name="chats", kind="multiturn", spec={"kind": "multiturn", "turns": 2}).pk
    return ids


def _concrete(path: str, ids: dict) -> str:
    resource = path.split("/")[2]
    return re.sub(r"\{[^}]+\}", str(ids.get(resource, 1)), path)


def test_the_schema_lists_every_resource_and_action():
    assert {"/api/nodes/", "/api/models/", "/api/copies/", "/api/deployments/", "/api/runs/"} <= set(PATHS)
    assert ("POST", "/api/deployments/{id}/stop/") in OPERATIONS and ("POST", "/api/models/{id}/download/") in OPERATIONS
    assert len(OPERATIONS) >= 25


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_anonymous_callers_get_401_everywhere(method, path, objects):
    response = api_client().generic(method, _concrete(path, objects))
    assert response.status_code == 401, f"{method} {path}: {response.status_code}"
    assert response.json()["error"]["code"] == "not_authenticated"


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_viewers_read_everything_and_change_nothing(method, path, objects, viewer):
    response = api_client(viewer).generic(method, _concrete(path, objects), "{}", content_type="application/json")
    if method == "GET":  # every read answers; only `fit` without its required `node` is a 400
        want = 400 if path == "/api/models/{id}/fit/" else 200
        assert response.status_code == want, f"{method} {path}: {response.status_code} {response.content[:200]}"
    else:
        assert response.status_code == 403, f"{method} {path}: {response.status_code}"
        assert response.json()["error"]["message"] == "Changing things needs the operator role."


# What an operator's empty request ("{}") gets from each change against the `objects` above: the
# action itself (202) or the service's refusal, never an authorisation answer. A new endpoint must be named here.
OPERATOR_ANSWERS = {
    ("DELETE", "/api/copies/{id}/"): (409, "in_use"),  # the ready deployment uses the copy
    ("DELETE", "/api/models/{id}/"): (409, "in_use"),  # the model has a copy and a deployment
    ("POST", "/api/copies/{id}/cancel/"): (409, "not_running"),
    ("POST", "/api/copies/{id}/retry/"): (409, "not_failed"),
    ("DELETE", "/api/deployments/{id}/"): (409, "busy"),  # the ready deployment must be stopped first
    ("POST", "/api/deployments/"): (400, "invalid"),  # model and node are required
    ("POST", "/api/deployments/{id}/persist/"): (400, "no_systemd"),
    ("POST", "/api/deployments/{id}/restart/"): (400, "invalid"),  # the factory's deployment has no GPUs
    ("POST", "/api/deployments/{id}/stop/"): (202, None),
    ("POST", "/api/deployments/{id}/sleep/"): (409, "no_sleep_mode"),  # not started with sleep mode
    ("POST", "/api/deployments/{id}/wake/"): (409, "not_sleeping"),
    ("POST", "/api/deployments/{id}/sleep-probe/"): (409, "no_sleep_mode"),
    ("POST", "/api/deployments/{id}/rollback/"): (409, "no_known_good"),
    ("POST", "/api/deployments/{id}/swap/"): (400, "invalid"),  # `to` is required
    ("POST", "/api/models/"): (400, "invalid"),
    ("POST", "/api/models/{id}/download/"): (400, "invalid"),  # node is required
    ("POST", "/api/nodes/{name}/measure-disk/"): (202, None),
    ("POST", "/api/runs/"): (400, "invalid"),  # a deployment or a base_url is required
    ("POST", "/api/runs/{id}/cancel/"): (202, None),
    ("POST", "/api/studies/"): (400, "invalid"),  # a deployment is required
    ("POST", "/api/studies/preview/"): (400, "invalid"),
    ("POST", "/api/studies/{id}/pause/"): (202, None),
    ("POST", "/api/studies/{id}/resume/"): (409, "not_paused"),
    ("POST", "/api/studies/{id}/cancel/"): (202, None),
    ("POST", "/api/studies/{id}/apply/"): (400, "invalid"),  # no winner yet, none chosen
    ("POST", "/api/workloads/"): (400, "invalid"),  # a name and a kind are required
    ("DELETE", "/api/workloads/{id}/"): (204, None),
    ("POST", "/api/keys/"): (400, "invalid"),  # a name is required
    ("PATCH", "/api/keys/{id}/"): (200, None),  # nothing given: nothing changed
    ("POST", "/api/keys/{id}/revoke/"): (200, None),
    ("POST", "/api/recipes/import/"): (400, "invalid"),  # source and files required (then: the admin role's)
    # Notifications: every user's own (the ids below are nobody's channel or subscription: 404).
    ("POST", "/api/notify/channels/"): (400, "invalid"),  # kind, name and target required
    ("DELETE", "/api/notify/channels/{id}/"): (404, "not_found"),
    ("POST", "/api/notify/channels/{id}/test/"): (404, "not_found"),
    ("PUT", "/api/notify/quiet/"): (400, "invalid"),  # start and end required (null for none)
    ("POST", "/api/notify/subscriptions/"): (201, None),  # no kinds, no deployment: every event, everywhere
    ("DELETE", "/api/notify/subscriptions/{id}/"): (404, "not_found"),
    ("PUT", "/api/notify/slos/{id}/"): (400, "invalid"),  # no objective given
    ("DELETE", "/api/notify/slos/{id}/"): (404, "not_found"),  # the deployment has none
}


def test_every_change_has_its_operator_answer_named():
    assert set(OPERATOR_ANSWERS) == {op for op in OPERATIONS if op[0] != "GET"}


@pytest.mark.parametrize("method, path", sorted(OPERATOR_ANSWERS))
def test_operators_may_change_things(method, path, objects, operator):
    response = api_client(operator).generic(method, _concrete(path, objects), "{}", content_type="application/json")
    status, code = OPERATOR_ANSWERS[method, path]
    assert response.status_code == status, f"{method} {path}: {response.status_code} {response.content[:300]}"
    if code:
        assert response.json()["error"]["code"] == code and response.json()["error"]["message"]


def test_a_repeated_post_with_the_same_idempotency_key_does_the_work_once(objects, operator, unique):
    client = api_client(operator)
    body = {"repo_id": "org/new-model"}
    with mock.patch("deployments.host.hub.repo_check", autospec=True, return_value="0" * 40):  # the hub knows it
        first = client.post("/api/models/", body, format="json", HTTP_IDEMPOTENCY_KEY=f"k-{unique}")
        again = client.post("/api/models/", body, format="json", HTTP_IDEMPOTENCY_KEY=f"k-{unique}")
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    BenchmarkRun.objects.update(status="done")
    other = client.post("/api/runs/", {"deployment": objects["deployments"]}, format="json", HTTP_IDEMPOTENCY_KEY=f"a-{unique}")
    busy = client.post("/api/runs/", {"deployment": objects["deployments"]}, format="json", HTTP_IDEMPOTENCY_KEY=f"b-{unique}")
    assert other.status_code == 202 and busy.status_code == 409 and "already measuring" in busy.json()["error"]["message"]
