"""The deployments API: deploy, stop, restart, events (long poll), logs, unit — and bad input."""

import pytest

from deployments.models import Deployment
from deployments.services import deploys
from tests.deployments.test_deploys import FLAGS
from tests.factories import DeploymentEventFactory, DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def setup(sent_tasks):
    node = NodeFactory(name="gpu-01", engine_flags=sorted(FLAGS))
    for i in range(4):
        GpuFactory(node=node, index=i)
    copy = ModelCopyFactory(node=node, path="/models/m")
    return node, copy.model


def test_deploy_answers_202_with_the_deployment(api, setup):
    node, model = setup
    response = api.post("/api/deployments/", {"model": model.pk, "node": "gpu-01", "gpus": [0, 1], "port": 8100,
                                              "engine_args": {"tensor-parallel-size": 2, "--max-model-len": 4096},
                                              "env": {"NCCL_PROTO": "LL"}, "preset": "none"}, format="json")
    assert response.status_code == 202, response.json()
    d = Deployment.objects.get()
    assert response.json()["id"] == d.pk and d.engine_args == {"tensor-parallel-size": 2, "max-model-len": 4096,
                                                         "served-model-name": model.repo_id}
    assert response.json()["gpus"] == [0, 1] and response.json()["status"] == "queued"


@pytest.mark.parametrize("body, field, text", [
    ({"engine_args": {"tensor-paralel-size": 2}}, "engine_args", "did you mean --tensor-parallel-size?"),
    ({"engine_args": {"max-num-seqs": {"$(reboot)": 1}}}, "engine_args", "a value is a string, number"),
    ({"env": {"LD_PRELOAD": "/tmp/evil.so"}}, "env", "LD_PRELOAD is not allowed"),
    ({"env": {"NCCL_PROTO": "LL\nrm -rf /"}}, "env", "printable"),
    ({"port": 80}, "port", "greater than or equal to 1024"),
    ({"gpus": [0, 1], "engine_args": {"tensor-parallel-size": 4}}, "tp", "needs 4 GPUs; 2 chosen"),
])
def test_bad_deploys_get_a_400_naming_the_field_and_nothing_runs(api, setup, body, field, text):
    node, model = setup
    response = api.post("/api/deployments/", {"model": model.pk, "node": "gpu-01", "gpus": [0], **body}, format="json")
    assert response.status_code == 400
    assert text in " ".join(response.json()["error"]["fields"][field])
    assert not Deployment.objects.exists()


def test_the_gateways_port_is_refused_to_an_engine_and_neither_it_nor_the_panels_is_offered(api, setup, settings):
    node, model = setup
    node.gateway_port = 4123
    node.save()
    response = api.post("/api/deployments/", {"model": model.pk, "node": "gpu-01", "gpus": [0], "port": 4123},
                        format="json")
    assert response.status_code == 409, response.content
    assert response.json()["error"]["message"] == "Port 4123 is gpu-01's gateway port: choose another port."
    assert not Deployment.objects.exists()
    settings.ENGINE_PORT_FIRST, settings.PANEL_PORT = 4122, 4124  # the panel's own, then the gateway's, are next
    assert deploys.deployment_free_port(node) == 4122
    DeploymentFactory(node=node, port=4122, status="ready")
    assert deploys.deployment_free_port(node) == 4125


def test_busy_gpus_answer_409_naming_the_holder(api, setup):
    node, model = setup
    holder = DeploymentFactory(node=node, status="loading", name="kimi-prod", port=9000)
    holder.gpus.set(node.gpus.filter(index=0))
    response = api.post("/api/deployments/", {"model": model.pk, "node": "gpu-01", "gpus": [0]}, format="json")
    assert response.status_code == 409 and "kimi-prod is loading" in response.json()["error"]["message"]
    assert response.json()["error"]["code"] == "gpus_busy"


def test_stop_restart_events_logs_and_unit(api, setup, sent_tasks):
    node, model = setup
    d = DeploymentFactory(node=node, model=model, status="ready", log_tail="a\nb", port=8100)
    d.gpus.set(node.gpus.filter(index=3))
    DeploymentEventFactory(deployment=d, step="launch")
    events = api.get(f"/api/deployments/{d.pk}/events/").json()
    assert events["status"] == "ready" and events["events"][0]["step"] == "launch"
    unchanged = api.get(f"/api/deployments/{d.pk}/events/?state={events['state']}&wait=1").json()
    assert unchanged["state"] == events["state"]
    DeploymentEventFactory(deployment=d, step="smoke_test")
    assert api.get(f"/api/deployments/{d.pk}/events/?state={events['state']}&wait=5").json()["events"][-1]["step"] == "smoke_test"
    assert api.get(f"/api/deployments/{d.pk}/logs/").json() == {"lines": ["a", "b"]}
    assert "ExecStart=" in api.get(f"/api/deployments/{d.pk}/unit/").json()["text"]
    restarted = api.post(f"/api/deployments/{d.pk}/restart/", {"port": 8200}, format="json").json()
    assert restarted.get("status") == "queued", restarted
    assert Deployment.objects.get(pk=d.pk).port == 8200
    assert api.post(f"/api/deployments/{d.pk}/restart/", {}, format="json").status_code == 409  # already queued
    assert api.post(f"/api/deployments/{d.pk}/stop/").json()["status"] == "stopping"
    assert (sent_tasks.commit()[-1].name, sent_tasks[-1].args) == ("deployments.deployment_halt", [d.pk])


def test_the_unit_to_install_by_hand_runs_the_copy_with_the_deployments_env_on_page_and_api(
        api, setup, viewer_client, monkeypatch):
    node, model = setup
    monkeypatch.setenv("AGENT_ONLY", "never in a unit")
    d = DeploymentFactory(node=node, model=model, status="ready", port=8100, name="tiny-prod", env={"NCCL_PROTO": "LL"})
    d.gpus.set(node.gpus.filter(index__in=[2, 3]))
    d.refresh_from_db()
    answer = api.get(f"/api/deployments/{d.pk}/unit/").json()
    page = viewer_client.get(f"/deployments/{d.pk}/unit/")
    assert page.content.decode() == answer["text"] and answer["name"] == "vllm-tiny-prod.service"
    assert page["Content-Disposition"] == 'attachment; filename="vllm-tiny-prod.service"'
    [exec_start] = [line for line in answer["text"].splitlines() if line.startswith("ExecStart=")]
    assert ['"serve"', '"/models/m"'] == exec_start.split()[1:3] and '"--port" "8100"' in exec_start
    assert 'Environment="NCCL_PROTO=LL"' in answer["text"] and 'Environment="CUDA_VISIBLE_DEVICES=2,3"' in answer["text"]
    assert "AGENT_ONLY" not in answer["text"]


def test_a_deploy_names_its_model_by_repo_id_as_panelctl_does(api, setup):
    """docs/api.md had no curl example and the API wanted the model's integer id where panelctl takes the repo id."""
    node, model = setup
    body = {"node": "gpu-01", "gpus": [0], "port": 8100, "preset": "none"}
    response = api.post("/api/deployments/", {"model": model.repo_id, **body}, format="json")
    assert response.status_code == 202, response.json()
    assert Deployment.objects.get().model == model
    for unknown in ("nobody/nothing", f"{model.repo_id}@no-such-revision"):
        refused = api.post("/api/deployments/", {"model": unknown, **body, "port": 8101}, format="json")
        assert refused.status_code == 400 and "model" in refused.json()["error"]["fields"], refused.json()
    assert Deployment.objects.count() == 1
