"""The deploy page: Deploy off while the fit check says the model will not fit, an admin's override,
"Check fit" for changed values, and only the fields that apply to the node (issue 27)."""
from unittest import mock

import pytest
from celery.app.task import Task
from django.urls import reverse

from deployments.models import Deployment
from tests.factories import GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
GiB = 2**30


@pytest.fixture
def sent():
    with mock.patch("deployments.dispatch.enqueue", autospec=True) as fn:
        yield fn


def _cpu(weights_gib: float):
    node = NodeFactory(name="cpu-01", ram_total=24 * GiB, cpu_count=2)
    model = ModelRepoFactory(repo_id="acme/big", files=[{"path": "model.safetensors", "size": int(weights_gib * GiB)}],
                             total_size=int(weights_gib * GiB))
    ModelCopyFactory(model=model, node=node, path="/models/big")
    return model, node


def _page(client, model, node, **data):
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    return client.post(url, {**data, "node_id": node.pk}) if data else client.get(url)


def test_deploy_is_off_where_the_model_does_not_fit_and_says_why(operator_client):
    model, node = _cpu(30)
    html = _page(operator_client, model, node).content.decode()
    assert 'id="deploy-submit" disabled' in html
    assert "Deploy is off: does not fit: needs ~34.0 GiB of RAM" in html and "--override-fit" in html
    assert 'name="override_fit"' not in html  # an operator cannot override


def test_an_admin_gets_deploy_anyway_and_a_model_that_fits_gets_deploy_on(client):
    model, node = _cpu(30)
    client.force_login(UserFactory(role="admin"))
    html = _page(client, model, node).content.decode()
    assert 'name="override_fit"' in html and "Deploy anyway, against the fit check" in html
    small = ModelRepoFactory(files=[{"path": "m.safetensors", "size": GiB}], total_size=GiB)
    ModelCopyFactory(model=small, node=node, path="/models/small")
    html = _page(client, small, node).content.decode()
    assert 'id="deploy-submit">' in html and "Deploy is off" not in html


def test_check_fit_weighs_the_values_sent_and_deploys_nothing(operator_client, sent, django_capture_on_commit_callbacks):
    model, node = _cpu(2)
    first = _page(operator_client, model, node).content.decode()
    assert "fits in RAM" in first and "Deploy is off" not in first
    data = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
            "stall_seconds": 600, "env": "VLLM_CPU_KVCACHE_SPACE=40", "check": "1"}
    with django_capture_on_commit_callbacks(execute=True):
        response = _page(operator_client, model, node, **data)
    assert response.status_code == 200 and not Deployment.objects.exists() and not sent.called
    html = response.content.decode()
    assert "KV cache 40.0 GiB" in html and 'id="deploy-submit" disabled' in html


def test_a_cpu_node_shows_no_gpu_or_multi_node_field_and_sends_their_defaults(operator_client):
    model, node = _cpu(1)
    html = _page(operator_client, model, node).content.decode()
    for name in ("gpus", "tp", "pp", "dp", "expert_parallel", "gpu_memory_utilization", "attention_backend",
                 "workers", "worker_gpus", "master_port"):
        assert f'data-field="{name}"' not in html, name
    assert '<input type="hidden" name="tp" value="1"' in html and 'name="gpu_memory_utilization" value="0.9"' in html
    assert 'data-field="max_num_seqs"' in html and "Stop other vLLM engines on this node" in html


def test_a_gpu_node_with_another_node_shows_the_gpu_and_multi_node_fields(operator_client):
    node = NodeFactory(name="gpu-01")
    GpuFactory(node=node, index=0)
    NodeFactory(name="gpu-02")
    model = ModelCopyFactory(node=node, path="/models/m").model
    html = _page(operator_client, model, node).content.decode()
    for name in ("gpus", "tp", "gpu_memory_utilization", "workers", "master_port"):
        assert f'data-field="{name}"' in html, name


FORM = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
        "stall_seconds": 600, "env": "VLLM_CPU_KVCACHE_SPACE=1"}


def test_a_deploy_sent_anyway_is_refused_naming_the_fit_and_an_admins_override_is_on_the_timeline(client, sent):
    model, node = _cpu(30)
    client.force_login(UserFactory(role="operator"))
    response = _page(client, model, node, **FORM, override_fit="on")  # Deploy pressed with the button forced on
    assert response.status_code == 409 and not Deployment.objects.exists()
    assert "Only an admin can deploy against the fit check" in response.content.decode()
    response = _page(client, model, node, **FORM)
    assert response.status_code == 409 and "acme/big does not fit cpu-01: needs ~34.0 GiB of RAM" in response.content.decode()
    client.force_login(UserFactory(role="admin"))
    response = _page(client, model, node, **FORM, override_fit="on")
    d = Deployment.objects.get()
    assert response.status_code == 302 and response["Location"] == reverse("deployment-detail", args=[d.pk])
    assert d.events.get(step="fit_override").message.startswith("Deployed although the fit check says does not fit")
