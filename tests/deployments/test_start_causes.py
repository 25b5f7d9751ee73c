"""A start that fails says why, with the fix, on the deployment itself (deployments/host/startcauses.py read by the
plan when the engine exits while loading); the node faked at its boundary as in tests/deployments/test_deploys.py."""
import pytest

from deployments.models import Deployment
from deployments.node import plan
from tests.deployments.test_deploys import FLAGS, FakeHost, host  # noqa: F401 - host: the plan's node, faked at its boundary
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
KV_SHORT = ("(EngineCore_DP0 pid=5812) ERROR 12-05 13:27:56 [core.py:1512] ValueError: To serve at least one request "
            "with the model's max seq len (262144), (30.52 GiB KV cache is needed, which is larger than the available KV "
            "cache memory (11.44 GiB). Based on the available memory, the estimated maximum model length is 98160. Try "
            "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.\n")


def _failed_start(host, tmp_path, log: str) -> Deployment:
    node = NodeFactory(model_store=str(tmp_path), engine_flags=sorted(FLAGS))
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    d = DeploymentFactory(node=node, model=copy.model, port=8000, status=Deployment.Status.QUEUED)

    def launch_then_exit(spec):
        handle = FakeHost.launch(host, spec)
        spec.log_path.write_text("INFO 12-05 13:27:30 [api_server.py:1858] vLLM API server version 0.32.0\n" + log)
        host.alive = False
        return handle

    host.mocks["processes.launch"].side_effect = launch_then_exit
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    return d


def test_a_kv_cache_too_small_fails_the_start_with_the_length_that_fits(host, tmp_path):
    d = _failed_start(host, tmp_path, KV_SHORT)
    assert d.status == Deployment.Status.FAILED
    assert d.status_message.startswith("The engine exited while loading: ValueError: To serve at least one request")
    assert d.status_message.endswith("vLLM says 98,160 tokens fit. Fix: --max-model-len 98160."), d.status_message


def test_a_start_whose_log_names_no_known_cause_fails_with_its_error_alone(host, tmp_path):
    d = _failed_start(host, tmp_path, "RuntimeError: something nobody has seen\n")
    assert d.status_message == "The engine exited while loading: RuntimeError: something nobody has seen"


def test_a_failure_is_recorded_even_when_the_docker_daemon_that_keeps_the_engine_is_away(host, tmp_path, monkeypatch):
    """A persisted engine in compose is released through Docker on a failure; a daemon that does not answer must not
    leave the deployment mid-plan (the keeper's error was not among those the failure path caught)."""
    from deployments.host import containers
    from deployments.node import steps

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    d = DeploymentFactory(status=Deployment.Status.READY, systemd_unit="container:vllm-panel-x-abc123")
    with pytest.raises(containers.ContainerError):
        containers.release("vllm-panel-x-abc123")  # what the failure's halt meets
    steps.fail(d, "Crashed: the engine process exited.")
    d.refresh_from_db()
    assert (d.status, d.status_message) == (Deployment.Status.FAILED, "Crashed: the engine process exited.")
