"""A deployment exported (deployments/exports.py) from the API, the page and panelctl: its deploy request, route and
versions in one JSON document, secrets masked; the request deploys it again once each secret's value is given, and a
mask sent as a value is refused everywhere a deploy is asked."""
import json

import pytest
from rest_framework.test import APIClient

from deployments import secrets
from deployments.gateway.models import Route
from deployments.models import Deployment
from deployments.services import deploys
from panelctl import cli
from plumbing.errors import ServiceError
from tests.deployments.test_versions import ADMIN, FLAGS, _end
from tests.factories import GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status


@pytest.fixture
def admin_api():
    client = APIClient()
    client.force_authenticate(ADMIN())
    return client


@pytest.fixture
def deployment(tmp_path, sent_tasks):
    node = NodeFactory(name="gpu-01", model_store=str(tmp_path), engine_flags=FLAGS, engine_version="0.32.0")
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * 10**9)
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(
        repo_id="moonshotai/Kimi-K2.5", files=[{"path": "a", "size": 1}]))
    d = deploys.deployment_create(model=copy.model, node=node, gpu_indices=[0, 1], port=8000, name="kimi",
                                  engine_args={"tensor-parallel-size": 2, "max-num-seqs": 64},
                                  env={"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_secret_value"}, user=ADMIN())
    Route.objects.create(deployment=d, names=["kimi-latest"], max_in_flight=32, queue_bound=100)
    _end(d, S.READY)
    deploys.deployment_redeploy(Deployment.objects.get(pk=d.pk), engine_args={"tensor-parallel-size": 2,
                                "max-num-seqs": 16}, env={"NCCL_DEBUG": "INFO", "HF_TOKEN": secrets.MASK}, user=ADMIN())
    return _end(d, S.FAILED, "The engine exited while it loaded.")


def test_the_export_holds_the_request_the_route_and_every_version_and_no_secret(deployment, api, operator_client):
    answer = api.get(f"/api/deployments/{deployment.pk}/export/")
    assert answer.status_code == 200 and answer["Content-Disposition"] == 'attachment; filename="kimi.json"'
    doc = answer.json()
    assert "hf_secret_value" not in answer.content.decode()
    assert doc["format"] == "vllm-controlpanel/deployment-export/1" and doc["secrets"] == ["HF_TOKEN"]
    body = doc["request"]
    assert (body["model"], body["node"], body["name"], body["gpus"], body["port"], body["preset"]) == (
        "moonshotai/Kimi-K2.5@main", "gpu-01", "kimi", [0, 1], 8000, "none")
    assert body["engine_args"] == {"tensor-parallel-size": 2, "max-num-seqs": 16,
                                   "served-model-name": deployment.served_model_name}
    assert body["env"] == {"NCCL_DEBUG": "INFO", "HF_TOKEN": secrets.MASK}
    assert (body["aliases"], body["max_in_flight"], body["queue_bound"]) == (["kimi-latest"], 32, 100)
    assert [(v["number"], v["outcome"], v["known_good"], v["changes"]) for v in doc["versions"]] == [
        (2, "failed", False, ["--max-num-seqs 64 → 16"]), (1, "ready", True, [])]
    assert doc["deployment"]["status"] == "failed"

    page = operator_client.get(f"/deployments/{deployment.pk}/export.json")  # the page's link: the same document, as a file
    assert page["Content-Disposition"] == 'attachment; filename="kimi.json"'
    assert {**json.loads(page.content), "exported": None} == {**doc, "exported": None}


def test_the_exported_request_deploys_again_once_each_secret_is_given_and_the_mask_is_refused(deployment, admin_api):
    body = {**admin_api.get(f"/api/deployments/{deployment.pk}/export/").json()["request"], "name": "kimi-copy",
            "gpus": [2, 3], "port": None, "aliases": ["kimi-copy"]}
    refused = admin_api.post("/api/deployments/", body, format="json")
    assert refused.status_code == 400, refused.content
    assert "HF_TOKEN holds ••••••, how the panel shows a secret, not its value" in refused.content.decode()
    assert not Deployment.objects.filter(name="kimi-copy").exists()

    made = admin_api.post("/api/deployments/", {**body, "env": {**body["env"], "HF_TOKEN": "hf_other"}}, format="json")
    assert made.status_code == 202, made.content
    copy = Deployment.objects.get(name="kimi-copy")
    assert copy.engine_args == deployment.engine_args and copy.gpu_indices == [2, 3]
    assert copy.env == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_other"}


def test_a_redeploy_refuses_a_mask_it_holds_no_value_for(deployment):
    with pytest.raises(ServiceError, match="MY_KEY holds ••••••"):
        deploys.deployment_redeploy(Deployment.objects.get(pk=deployment.pk),
                                    env={"NCCL_DEBUG": "INFO", "HF_TOKEN": secrets.MASK, "MY_KEY": secrets.MASK})


def test_panelctl_exports_to_a_file_and_imports_it_with_the_secret_given(deployment, admin_api, monkeypatch, tmp_path,
                                                                          capsys):
    class Panel:  # panelctl's client, answered by the panel's own API
        def __init__(self, *a):
            pass

        def get(self, path, **params):
            answer = admin_api.get("/api/" + path, params)
            assert answer.status_code == 200, answer.content
            return answer.json()

        def post(self, path, body=None, key=None):
            answer = admin_api.post("/api/" + path, body, format="json")
            assert answer.status_code == 202, answer.content
            return answer.json()

    monkeypatch.setattr(cli, "Panel", Panel)
    out = tmp_path / "kimi.json"
    assert cli.main(["--url", "http://x", "--token", "t", "export-deployment", "kimi", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["request"]["env"]["HF_TOKEN"] == secrets.MASK
    assert cli.main(["--url", "http://x", "--token", "t", "import-deployment", str(out), "--name", "kimi-2",
                     "--env", "HF_TOKEN=hf_imported"]) == 0
    assert "Deploying kimi-2" in capsys.readouterr().err
    made = Deployment.objects.get(name="kimi-2")
    assert made.env["HF_TOKEN"] == "hf_imported" and made.engine_args == deployment.engine_args
