"""Options that run code, load files or redirect the engine need the admin role; paths stay in the model's folder."""

import pytest

from deployments.models import Deployment
from tests.factories import GpuFactory, ModelCopyFactory, NodeFactory, UserFactory
from tests.helpers import api_client

pytestmark = pytest.mark.django_db
FLAGS = ["--tensor-parallel-size", "--trust-remote-code", "--tool-parser-plugin", "--middleware", "--chat-template",
         "--config", "--max-num-seqs", "--port", "--host", "--model", "--gpu-memory-utilization"]


@pytest.fixture
def world(sent_tasks):
    node = NodeFactory(name="gpu-01", engine_flags=FLAGS)
    GpuFactory(node=node, index=0)
    copy = ModelCopyFactory(node=node, path="/models/org/m")
    return node, copy.model


def _deploy(client, model, **kw):
    body = {"model": model.pk, "node": "gpu-01", "gpus": [0], "engine_args": {"tensor-parallel-size": 1}, "env": {}}
    return client.post("/api/deployments/", {**body, **kw}, format="json")


@pytest.mark.parametrize("args, env", [
    ({"trust-remote-code": True}, {}), ({"tool-parser-plugin": "/models/org/m/p.py"}, {}),
    ({"middleware": "evil.Middleware"}, {}), ({"chat-template": "/models/org/m/t.jinja"}, {}),
    ({}, {"VLLM_SERVER_DEV_MODE": "1"}), ({}, {"VLLM_LOGGING_CONFIG_PATH": "/tmp/x.json"}), ({}, {"HF_ENDPOINT": "http://x"}),
    ({}, {"HF_HUB_OFFLINE": "0"}), ({}, {"VLLM_PLUGINS": "evil"}), ({}, {"NCCL_NET_PLUGIN": "evil"}),
])
def test_an_operator_cannot_set_a_privileged_option_and_an_admin_can(world, operator, args, env):
    node, model = world
    refused = _deploy(api_client(operator), model, engine_args={"tensor-parallel-size": 1, **args}, env=env)
    assert refused.status_code == 403 and "admin role" in refused.json()["error"]["message"]
    assert not Deployment.objects.exists()
    admin = UserFactory(role="admin")
    assert _deploy(api_client(admin), model, engine_args={"tensor-parallel-size": 1, **args}, env=env).status_code == 202


@pytest.mark.parametrize("path", ["/etc/passwd", "/models/org/m/../../etc/passwd", "~/.ssh/id_rsa", "../x.jinja",
                                  "/models/org/mx/t.jinja"])
def test_a_file_path_outside_the_models_folder_is_refused_even_for_an_admin(world, path):
    node, model = world
    response = _deploy(api_client(UserFactory(is_superuser=True)), model, engine_args={"tensor-parallel-size": 1, "chat-template": path})
    assert response.status_code == 400 and "inside the model's folder" in response.json()["error"]["message"]


def test_an_operator_may_restart_and_retune_what_an_admin_set_but_not_change_it(world, operator):
    node, model = world
    admin = UserFactory(role="admin")
    d = _deploy(api_client(admin), model, engine_args={"tensor-parallel-size": 1, "trust-remote-code": True}).json()
    Deployment.objects.filter(pk=d["id"]).update(status="ready")
    ok = api_client(operator).post(f"/api/deployments/{d['id']}/restart/",
                             {"engine_args": {"tensor-parallel-size": 1, "trust-remote-code": True, "max-num-seqs": 8}}, format="json")
    assert ok.status_code == 202
    Deployment.objects.filter(pk=d["id"]).update(status="ready")
    changed = api_client(operator).post(f"/api/deployments/{d['id']}/restart/",
                                  {"engine_args": {"tensor-parallel-size": 1, "chat-template": "t.jinja"}}, format="json")
    assert changed.status_code == 403


def test_the_deploy_form_warns_about_privileged_options_and_refuses_them_to_operators(world, operator_client):
    node, model = world
    page = operator_client.get(f"/models/{model.pk}/deploy/?node={node.pk}").content.decode()
    assert "Privileged options" in page and "need the admin role" in page and "--trust-remote-code" in page
    response = operator_client.post(f"/models/{model.pk}/deploy/", {
        "node_id": node.pk, "gpus": ["0"], "port": 8000, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9,
        "kv_cache_dtype": "auto", "stall_seconds": 600, "trust_remote_code": "on"})
    assert response.status_code == 409 and "Needs the admin role" in response.content.decode()
    assert not Deployment.objects.exists()
