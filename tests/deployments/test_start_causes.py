"""A start that fails says why, with the fix, on the deployment itself (deployments/host/startcauses.py read by the
plan when the engine exits while loading); the node faked at its boundary as in tests/deployments/test_deploys.py."""
import re

import pytest

from deployments.models import Deployment
from deployments.node import plan
from tests.deployments.test_deploys import FLAGS, FakeHost, host  # noqa: F401 - host: the plan's node, faked at its boundary
from tests.deployments.test_panelctl_refusals import login  # noqa: F401 (a fixture)
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
KV_SHORT = ("(EngineCore_DP0 pid=5812) ERROR 12-05 13:27:56 [core.py:1512] ValueError: To serve at least one request "
            "with the model's max seq len (262144), (30.52 GiB KV cache is needed, which is larger than the available KV "
            "cache memory (11.44 GiB). Based on the available memory, the estimated maximum model length is 98160. Try "
            "increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.\n")


def _failed_start(host, tmp_path, log: str, fails: int = 1, **fields) -> Deployment:
    """A deployment whose first `fails` starts write `log` and exit (the later ones load), its plan run once."""
    node = NodeFactory(model_store=str(tmp_path), engine_flags=sorted(FLAGS))
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    d = DeploymentFactory(node=node, model=copy.model, port=8000, status=Deployment.Status.QUEUED, **fields)
    starts = []

    def launch(spec):
        handle = FakeHost.launch(host, spec)
        starts.append(spec.argv)
        host.alive = len(starts) > fails
        if not host.alive:
            spec.log_path.write_text("INFO 12-05 13:27:30 [api_server.py:1858] vLLM API server version 0.32.0\n" + log)
        host.health_after = 3
        return handle

    host.mocks["processes.launch"].side_effect = launch
    host.starts = starts
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


def test_a_deployment_that_asked_retries_once_with_the_advised_setting_and_is_ready(host, tmp_path, sent_tasks):
    d = _failed_start(host, tmp_path, KV_SHORT, retry_advised=True, engine_args={"max-num-seqs": "8"})
    assert d.status == Deployment.Status.QUEUED and not d.retry_advised, "queued once more, the retry used up"
    assert d.engine_args == {"max-num-seqs": "8", "max-model-len": "98160"}
    said = d.events.get(step="advised_retry").message
    assert said.startswith("Starting once more with --max-model-len 98160"), said
    assert sent_tasks.commit().one("deployments.deployment_run").args == [d.pk]
    plan.deployment_run(d.pk)  # what the queued plan does on the node
    d.refresh_from_db()
    assert d.status == Deployment.Status.READY, d.status_message
    assert "98160" in host.starts[-1][host.starts[-1].index("--max-model-len") + 1]


def test_the_retry_happens_once_and_never_without_being_asked(host, tmp_path, sent_tasks):
    twice = _failed_start(host, tmp_path, KV_SHORT, fails=2, retry_advised=True)
    plan.deployment_run(twice.pk)
    twice.refresh_from_db()
    assert twice.status == Deployment.Status.FAILED and twice.events.filter(step="advised_retry").count() == 1
    assert "Fix: --max-model-len 98160." in twice.status_message, "the same cause, said again: nothing more is tried"
    unasked = _failed_start(host, tmp_path, KV_SHORT)
    assert unasked.status == Deployment.Status.FAILED and not unasked.events.filter(step="advised_retry").exists()
    unknown = _failed_start(host, tmp_path, "RuntimeError: something nobody has seen\n", retry_advised=True)
    assert unknown.status == Deployment.Status.FAILED and unknown.retry_advised, "no certain fix: nothing to retry"


def test_the_api_the_form_and_panelctl_ask_for_the_retry_on_a_new_deployment_and_not_on_a_change(
        api, tmp_path, sent_tasks, operator_client, login, live_server_asgi):  # noqa: F811
    from panelctl import cli
    from tests.factories import GpuFactory

    node = NodeFactory(name="gpu-01", model_store=str(tmp_path), engine_version="0.32.0", engine_flags=sorted(FLAGS))
    GpuFactory(node=node, index=0)
    model = ModelCopyFactory(node=node, path=str(tmp_path / "org--m"), model__repo_id="org/m",
                             model__files=[{"path": "a", "size": 1}]).model
    body = {"model": model.pk, "node": "gpu-01", "gpus": [0], "preset": "none", "engine_args": {"max-model-len": 4096}}
    made = api.post("/api/deployments/", body, format="json").json()
    assert made["retry_advised"] is True, "a new deployment asks for it unless told not to"
    d = Deployment.objects.get(pk=made["id"])
    Deployment.objects.filter(pk=d.pk).update(status=Deployment.Status.FAILED)
    assert api.post(f"/api/deployments/{d.pk}/restart/", {}, format="json").json()["retry_advised"] is False
    Deployment.objects.filter(pk=d.pk).update(status=Deployment.Status.FAILED)
    assert api.post(f"/api/deployments/{d.pk}/restart/", {"retry_advised": True}, format="json").json()["retry_advised"]
    box = re.compile(r'<input type="checkbox" name="retry_advised"[^>]*\bchecked')
    assert box.search(operator_client.get(f"/models/{model.pk}/deploy/?node={node.pk}").content.decode())
    Deployment.objects.filter(pk=d.pk).update(status=Deployment.Status.FAILED)
    edit = operator_client.get(f"/deployments/{d.pk}/edit/").content.decode()
    assert 'name="retry_advised"' in edit and not box.search(edit)
    Deployment.objects.all().delete()
    assert cli.main([*login, "deploy", "org/m", "--node", "gpu-01", "--gpus", "0", "--no-retry-advised",
                     "--preset", "none"]) == 0
    assert Deployment.objects.get().retry_advised is False


def test_an_engine_that_writes_its_error_and_exits_between_two_reads_of_its_log_fails_with_that_error(
        host, tmp_path, monkeypatch):
    """The follow reads the log, then asks whether the engine runs: lines written between the two (the error, then
    the exit) are read before the failure is told, not lost for the line before them."""
    def exits_after_writing(p, *a, **kw):
        with open(p.log_path, "a") as log:
            log.write("RuntimeError: written as it exited\n")
        return False

    monkeypatch.setattr(plan.lifecycle, "still_running", exits_after_writing)
    d = _failed_start(host, tmp_path, "", fails=0)
    assert d.status_message == "The engine exited while loading: RuntimeError: written as it exited", d.status_message
