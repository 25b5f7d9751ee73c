"""Small 500s and hangs found while reading the code, each kept as a regression test."""
import json
import os
from unittest import mock

import pytest
from rest_framework.test import APIClient

from deployments.host import hub, store
from deployments.models import ModelRepo
from deployments.services import repos
from tests.factories import ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("query", ["days=nan", "since=nan", "since=-inf", "days=-1", "since=inf"])
def test_node_history_answers_400_to_numbers_that_are_not(viewer_client, query):
    node = NodeFactory()
    response = viewer_client.get(f"/nodes/{node.pk}/history.json?{query}")
    assert response.status_code == 400 and "finite" in response.json()["error"]


def test_a_config_without_num_hidden_layers_says_why_instead_of_reading_forever(viewer_client):
    model = ModelRepoFactory(repo_id="org/odd")
    info = hub.RepoInfo("org/odd", "main", "f" * 40, [hub.RepoFile("config.json", 10, None, "c" * 40)],
                        {"architectures": ["OddForCausalLM"], "hidden_size": 64}, 10)
    with mock.patch("deployments.host.hub.repo_info", autospec=True, return_value=info):
        repos.model_inspect(model.pk)
    model.refresh_from_db()
    assert model.inspected and "num_hidden_layers" in model.inspect_error
    NodeFactory().gpus.create(index=0, uuid="GPU-x", name="H200", memory_total=141 * 10**9)
    page = viewer_client.get(f"/models/{model.pk}/")
    assert page.status_code == 200 and "Reading the repository" not in page.content.decode()


@pytest.mark.parametrize("path", ["/", "/proc", "/etc/ssh", "/home", "/sys/kernel", "/tmp/", "/./etc"])
def test_a_system_folder_is_refused_as_a_local_model(operator, path, sent_tasks):
    NodeFactory(name="n1")
    client = APIClient()
    client.force_authenticate(operator)
    response = client.post("/api/models/", {"node": "n1", "local_path": path}, format="json")
    assert response.status_code == 400 and "local_path" in response.json()["error"]["fields"]
    assert not sent_tasks and not ModelRepo.objects.exists()


def test_the_agent_refuses_to_walk_a_folder_without_a_config(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "big.bin").write_bytes(b"x")
    with mock.patch.object(os, "walk", autospec=True) as walk, pytest.raises(store.StoreError, match="config.json"):
        store.inspect_local(tmp_path, [str(tmp_path)])
    assert not walk.called
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert store.inspect_local(tmp_path, [str(tmp_path)]).files == [("a/big.bin", 1), ("config.json", 2)]


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/x", "http:/\\evil.example", "javascript:alert(1)"])
def test_copy_actions_never_redirect_off_site(operator_client, target, sent_tasks):
    copy = ModelCopyFactory(state="failed")
    response = operator_client.post(f"/copies/{copy.pk}/retry/", {"next": target})
    assert response.status_code == 302 and response["Location"] == f"/models/{copy.model_id}/"
    inside = operator_client.post(f"/copies/{copy.pk}/cancel/", {"next": "/models/"})
    assert inside["Location"] == "/models/"
