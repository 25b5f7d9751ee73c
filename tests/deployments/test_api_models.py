"""The models and copies API: add, fit, download, cancel, retry, delete, and their errors."""
from unittest import mock

import pytest
from rest_framework.test import APIClient

from deployments.models import ModelCopy, ModelRepo
from tests.deployments.test_model_services import GiB, _inspected
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer_api(viewer):
    client = APIClient()
    client.force_authenticate(viewer)
    return client


@pytest.fixture(autouse=True)
def no_hub(sent_tasks):
    """The Hub's answer for every repo, and the queue recorded."""
    with mock.patch("deployments.host.hub.repo_check", autospec=True, return_value="0" * 40):
        yield


def test_adding_a_repo_answers_202_and_queues_the_inspection(api, sent_tasks):
    response = api.post("/api/models/", {"repo_id": "moonshotai/Kimi-K2.5"}, format="json")
    assert response.status_code == 202
    model = ModelRepo.objects.get(repo_id="moonshotai/Kimi-K2.5")
    assert response.json()["id"] == model.pk and model.revision == "main"
    assert sent_tasks.commit().one("deployments.model_inspect").args == [model.pk]


@pytest.mark.parametrize("body, field", [
    ({"repo_id": "org/model; rm -rf /"}, "repo_id"),
    ({"repo_id": "../../etc/passwd"}, "repo_id"),
    ({"repo_id": "org/model", "revision": "main && reboot"}, "revision"),
    ({"repo_id": "x" * 500}, "repo_id"),
    ({"local_path": "/models/$(whoami)", "node": "n"}, "local_path"),
    ({"local_path": "/models/../etc"}, "local_path"),
    ({}, "repo_id"),
])
def test_bad_input_gets_a_400_naming_the_field_and_creates_nothing(api, body, field):
    NodeFactory(name="n")
    response = api.post("/api/models/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()["error"]["fields"]
    assert not ModelRepo.objects.exists()


def test_a_viewer_cannot_add_or_download(viewer_api):
    model = _inspected()
    assert viewer_api.post("/api/models/", {"repo_id": "a/b"}, format="json").status_code == 403
    assert viewer_api.post(f"/api/models/{model.pk}/download/", {"node": "x"}, format="json").status_code == 403
    assert viewer_api.get(f"/api/models/{model.pk}/").status_code == 200


def test_download_answers_202_with_the_copy_to_follow(api):
    model = _inspected()
    NodeFactory(name="gpu-01", disk_total=100 * GiB, disk_free=90 * GiB)
    response = api.post(f"/api/models/{model.pk}/download/", {"node": "gpu-01"}, format="json")
    assert response.status_code == 202
    copy = ModelCopy.objects.get(model=model)
    assert response.json()["id"] == copy.pk and response.json()["state"] == "queued"
    assert api.get(f"/api/copies/{copy.pk}/").json()["bytes_total"] == model.total_size


def test_a_short_disk_answers_409_with_figures_and_what_to_delete(api):
    model = _inspected()
    node = NodeFactory(name="gpu-02", disk_total=20 * GiB, disk_free=GiB)
    other = ModelCopyFactory(node=node, bytes_done=15 * GiB)
    response = api.post(f"/api/models/{model.pk}/download/", {"node": "gpu-02"}, format="json")
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "disk_full" and error["needed"] == model.total_size and error["free"] == GiB
    assert error["candidates"][0]["id"] == other.pk and "node" in error["fields"]


def test_fit_answers_with_the_figures(api):
    model = _inspected()
    node = NodeFactory(name="h200")
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * GiB)
    fit = api.get(f"/api/models/{model.pk}/fit/?node=h200&tp=8").json()
    assert fit["fits"] is True and fit["kv_tokens"] > 0 and fit["tp"] == 8
    assert api.get(f"/api/models/{model.pk}/fit/?node=h200&tp=0").status_code == 400


def test_copies_can_be_cancelled_retried_and_deleted_but_not_while_in_use(api):
    copy = ModelCopyFactory(state="downloading")
    assert api.post(f"/api/copies/{copy.pk}/cancel/").json()["state"] == "downloading"
    assert ModelCopy.objects.get(pk=copy.pk).cancel_requested
    assert api.post(f"/api/copies/{copy.pk}/retry/").status_code == 409
    ready = ModelCopyFactory()
    DeploymentFactory(node=ready.node, model=ready.model, status="ready", name="in-use")
    response = api.delete(f"/api/copies/{ready.pk}/")
    assert response.status_code == 409 and "in-use" in response.json()["error"]["message"]
    idle = ModelCopyFactory()
    assert api.delete(f"/api/copies/{idle.pk}/").json()["state"] == "deleting"


def test_the_model_and_copy_lists_cost_the_same_queries_for_one_copy_or_twelve(api):
    """They read only what they show (no node or model JSON columns): a field they show but did not read would
    cost one query per row."""
    from plumbing import apicache

    def queries(path):
        apicache.clear()
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as captured:
            answer = api.get(path)
        assert answer.status_code == 200
        return len(captured), answer.json()["results"]

    ModelCopyFactory(progress={"files": {}, "seconds_left": 3.0})
    queries("/api/copies/")  # the first request of a process reads what later ones find cached (the versions)
    one = {path: queries(path) for path in ("/api/copies/", "/api/models/")}
    for _ in range(11):
        ModelCopyFactory(progress={"files": {}, "seconds_left": 3.0})
    twelve = {path: queries(path) for path in ("/api/copies/", "/api/models/")}
    assert {p: n for p, (n, _) in twelve.items()} == {p: n for p, (n, _) in one.items()}
    copies = twelve["/api/copies/"][1]
    assert len(copies) == 12 and all(c["node"] and c["model"] and "percent" in c for c in copies)
    assert sum(len(m["copies"]) for m in twelve["/api/models/"][1]) == 12


@pytest.mark.parametrize("fields", [
    {},
    {"bytes_done": 3 * GiB, "bytes_total": 7 * GiB, "rate": 2.5e8, "progress": {"files": {"a": [1, 2]}, "seconds_left": 16.0},
     "error": "disk full", "error_code": "disk_full"},
    {"bytes_total": 0, "rate": 0.0, "state": "ready", "path": "/models/x"},
])
def test_a_copy_written_out_is_what_drfs_fields_give(fields, db):
    from django.utils import timezone

    from deployments.api.serializers import ModelCopySerializer
    from rest_framework.serializers import ModelSerializer

    copy = ModelCopyFactory(**fields)
    for last_used in (None, timezone.now()):
        copy.last_used = last_used
        serializer = ModelCopySerializer(copy)
        assert serializer.to_representation(copy) == ModelSerializer.to_representation(serializer, copy)
