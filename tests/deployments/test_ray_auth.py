"""Every Ray cluster the panel starts is authenticated: a new token at each Ray head start,
handed to each Ray node, to `vllm serve` (Ray's driver) and to the panel's own status calls through the
environment, never argv; stored write-only; the dashboard is not started.

The real cluster refusing a client without the token is tests/e2e/test_ray.py."""
from unittest import mock

import pytest
from rest_framework.test import APIClient

from deployments import sealed
from deployments.host import processes, raynode
from deployments.models import Deployment, DeploymentRank
from deployments.node import plan, ranks
from tests.deployments.test_deploys import FLAGS, host, model, node  # noqa: F401 - fixtures
from tests.deployments.test_multinode import _node
from tests.factories import DeploymentFactory, UserFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status
RAY = {"tensor-parallel-size": 2, "distributed-executor-backend": "ray", "served-model-name": "tiny"}


@pytest.fixture
def ray_host(host):
    host.mocks["serveargv.engine_flags"].return_value = FLAGS | {"--distributed-executor-backend"}
    with mock.patch("deployments.host.raynode.check_installed", autospec=True), \
         mock.patch("deployments.host.raynode.alive_nodes", autospec=True, return_value=1) as alive, \
         mock.patch("deployments.host.ownership.find", autospec=True, return_value=[31337]):
        host.alive_nodes = alive
        yield host


def _ray_run(model, node, host, env=None):
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.QUEUED, master_port=29600, engine_args=RAY,
                          env=env or {})
    d.gpus.set(node.gpus.filter(index__in=[0, 1]))
    host.mocks["processes.launch"].reset_mock()
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    (ray_spec,), (vllm_spec,) = (c.args for c in host.mocks["processes.launch"].call_args_list)
    return d, ray_spec, vllm_spec


def test_the_ray_head_vllm_and_the_panels_status_calls_get_the_deployments_token_in_their_environment(
        model, node, ray_host):
    d, ray_spec, vllm_spec = _ray_run(model, node, ray_host, env={"RAY_AUTH_MODE": "disabled"})
    assert sealed.is_sealed(d.ray_token)  # the row holds ciphertext (deployments/sealed.py)
    token = sealed.unseal(d.ray_token)
    assert len(token) == 64 and token not in d.ray_token
    for spec in (ray_spec, vllm_spec):
        assert spec.env["RAY_AUTH_MODE"] == "token" and spec.env["RAY_AUTH_TOKEN"] == token  # set last: wins
        assert token not in " ".join(spec.argv)  # argv is every local user's to read
    asked = ray_host.alive_nodes.call_args
    assert asked.args[2]["RAY_AUTH_TOKEN"] == token and asked.args[2]["RAY_AUTH_MODE"] == "token"
    argv = ray_spec.argv
    assert argv[argv.index("--node-ip-address") + 1] == node.address
    assert argv[argv.index("--include-dashboard") + 1] == "false"
    assert ray_spec.env["RAY_enable_metrics_collection"] == "0"  # no Prometheus endpoint on every interface
    again, _, _ = _ray_run(model, node, ray_host)
    assert sealed.unseal(again.ray_token) != token  # each cluster its own


def test_a_worker_nodes_ray_reads_the_token_the_head_made_after_its_row_was_loaded(tmp_path, settings):
    settings.VAR_DIR = tmp_path
    head, worker = _node("gpu-a"), _node("gpu-b")
    worker.address, worker.model_store = "10.0.0.2", str(tmp_path / "models")
    worker.save()
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    d = DeploymentFactory(node=head, status=S.STARTING, master_port=29600, engine_args=RAY)
    r = DeploymentRank.objects.create(deployment=d, node=worker, rank=1, gpu_indices=[0, 1])
    r = DeploymentRank.objects.select_related("deployment__node", "node").get(pk=r.pk)  # loaded before the head's start
    with mock.patch("deployments.host.raynode.check_installed", autospec=True), \
         mock.patch("deployments.host.processes.launch", autospec=True,
                    return_value=processes.EngineHandle(pid=5151, pgid=5151)) as launch:
        with pytest.raises(plan.PlanFailed, match="no token"):
            ranks._launch(r, str(folder))  # never a Ray node without authentication
        launch.assert_not_called()
        Deployment.objects.filter(pk=d.pk).update(ray_token="t" * 64)
        ranks._launch(r, str(folder))
    spec = launch.call_args.args[0]
    assert spec.env["RAY_AUTH_TOKEN"] == "t" * 64 and spec.env["RAY_AUTH_MODE"] == "token"
    assert spec.argv[spec.argv.index("--node-ip-address") + 1] == "10.0.0.2" and "t" * 64 not in spec.argv


def test_the_token_is_never_shown_by_the_api_or_the_page(client):
    admin = UserFactory(role="admin")
    d = DeploymentFactory(status=S.READY, master_port=29600, engine_args=RAY, ray_token="s3cr3t" * 10)
    api = APIClient()
    api.force_authenticate(admin)
    shown = api.get(f"/api/deployments/{d.pk}/")
    assert shown.status_code == 200 and "s3cr3t" not in shown.content.decode()
    client.force_login(admin)
    page = client.get(f"/deployments/{d.pk}/")
    assert page.status_code == 200 and "s3cr3t" not in page.content.decode()


def test_auth_env_refuses_an_empty_token():
    with pytest.raises(raynode.RayError):
        raynode.auth_env("")
    assert raynode.auth_env("x") == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x"}
