"""Every API endpoint against every role: anonymous gets 401, a viewer reads but cannot change,
an operator may change. The endpoints come from the schema, so new ones are covered too."""
import re
from unittest import mock

import pytest
from celery.app.task import Task
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from benchmarks.models import BenchmarkRun
from tests.factories import BenchmarkRunFactory, DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db
PATHS = SchemaGenerator().get_schema(request=None, public=True)["paths"]
OPERATIONS = [(method.upper(), path) for path, ops in PATHS.items() for method in ops
              if method in ("get", "post", "put", "patch", "delete") and path.startswith("/api/")]
DOCS = {"/api/schema/", "/api/docs/"}


@pytest.fixture
def objects():
    node = NodeFactory(name="n1")
    GpuFactory(node=node, index=0)
    copy = ModelCopyFactory(node=node)
    d = DeploymentFactory(node=node, model=copy.model, status="ready")
    run = BenchmarkRunFactory(deployment=d)
    ids = {"nodes": node.name, "models": copy.model.pk, "copies": copy.pk, "deployments": d.pk, "runs": run.pk}
    with mock.patch.object(Task, "apply_async", autospec=True):
        yield ids


def _concrete(path: str, ids: dict) -> str:
    resource = path.split("/")[2]
    return re.sub(r"\{[^}]+\}", str(ids.get(resource, 1)), path)


def _client(user=None):
    client = APIClient()
    if user:
        client.force_authenticate(user)
    return client


def test_the_schema_lists_every_resource_and_action():
    assert {"/api/nodes/", "/api/models/", "/api/copies/", "/api/deployments/", "/api/runs/"} <= set(PATHS)
    assert ("POST", "/api/deployments/{id}/stop/") in OPERATIONS and ("POST", "/api/models/{id}/download/") in OPERATIONS
    assert len(OPERATIONS) >= 25


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_anonymous_callers_get_401_everywhere(method, path, objects):
    response = _client().generic(method, _concrete(path, objects))
    assert response.status_code == 401, f"{method} {path}: {response.status_code}"
    assert response.json()["error"]["code"] == "not_authenticated"


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_viewers_read_everything_and_change_nothing(method, path, objects, viewer):
    response = _client(viewer).generic(method, _concrete(path, objects), "{}", content_type="application/json")
    if method == "GET":  # 400 when a required query parameter is missing, but never a refusal
        assert response.status_code in (200, 400), f"{method} {path}: {response.status_code} {response.content[:200]}"
    else:
        assert response.status_code == 403, f"{method} {path}: {response.status_code}"
        assert response.json()["error"]["message"] == "Changing things needs the operator role."


@pytest.mark.parametrize("method, path", [op for op in OPERATIONS if op[0] != "GET"])
def test_operators_may_change_things(method, path, objects, operator):
    response = _client(operator).generic(method, _concrete(path, objects), "{}", content_type="application/json")
    assert response.status_code not in (401, 403, 405, 500), f"{method} {path}: {response.status_code} {response.content[:300]}"
    body = response.json()
    if response.status_code >= 400:
        assert set(body["error"]) >= {"code", "message", "fields"}


def test_a_repeated_post_with_the_same_idempotency_key_does_the_work_once(objects, operator, unique):
    client = _client(operator)
    body = {"repo_id": "org/new-model"}
    first = client.post("/api/models/", body, format="json", HTTP_IDEMPOTENCY_KEY=f"k-{unique}")
    again = client.post("/api/models/", body, format="json", HTTP_IDEMPOTENCY_KEY=f"k-{unique}")
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    BenchmarkRun.objects.update(status="done")
    other = client.post("/api/runs/", {"deployment": objects["deployments"]}, format="json", HTTP_IDEMPOTENCY_KEY=f"a-{unique}")
    busy = client.post("/api/runs/", {"deployment": objects["deployments"]}, format="json", HTTP_IDEMPOTENCY_KEY=f"b-{unique}")
    assert other.status_code == 202 and busy.status_code == 409 and "already measuring" in busy.json()["error"]["message"]
