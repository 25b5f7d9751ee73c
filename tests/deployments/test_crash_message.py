"""The crash message says what happened (issue: "Crashed: the engine process exited. Last log lines:" followed by the
panel's own /health polls): the signal and its meaning, an OOM kill seen on the host meanwhile, the engine's own
last lines, and the badge "Crashed". The host is replaced at its boundary (test_deploys.FakeHost); the exit code of a
real killed process is tests/host/test_exits.py's, and the real CPU engine's is tests/e2e/test_prometheus.py's."""
from unittest import mock

import pytest

from deployments import payloads
from deployments.models import Deployment
from deployments.node import watch
from tests.deployments.test_deploys import host, model, node  # noqa: F401 - fixtures
from tests.factories import DeploymentFactory
from tests.host.test_exits import POLLED

pytestmark = pytest.mark.django_db
S = Deployment.Status


def test_a_sigkilled_engine_is_crashed_with_the_signal_the_oom_kill_and_its_own_last_lines(model, node, host, tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("\n".join(POLLED) + "\n")
    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=4242, pgid=4242, log_path=str(log))
    state = {}
    with mock.patch("deployments.host.exits.oom_kills", side_effect=[7, 8]):
        watch.deployments_watch(node.pk, state)  # alive: the pass notes the host's OOM kills so far
        host.alive = False
        with mock.patch("deployments.host.processes.exit_code", return_value=-9):
            watch.deployments_watch(node.pk, state)
    d.refresh_from_db()
    assert d.status == S.FAILED and d.badge == "Crashed"
    assert d.status_message.startswith(
        "Crashed: the engine process exited, killed by SIGKILL (signal 9): killed from outside: by the kernel's OOM "
        "killer or by someone's kill -9; the kernel's OOM killer killed 1 process on this host meanwhile")
    assert "CUDA error: out of memory" in d.status_message and "POST /v1/chat/completions" in d.status_message
    assert "GET /health" not in d.status_message and "GET /metrics" not in d.status_message
    assert payloads.DeploymentStatus.of(d).status_display == "Crashed"


def test_a_failure_that_is_not_a_crash_keeps_its_badge(model, node):
    d = DeploymentFactory(model=model, node=node, status=S.FAILED, status_message="Stalled: neither the log nor GPU memory moved")
    assert d.badge == "Failed"


def test_a_failed_deployment_can_be_deleted_from_its_page_and_a_serving_one_cannot(operator_client, model, node):
    """Failed deployments piled up with no way to remove them from the pages."""
    failed = DeploymentFactory(model=model, node=node, status=S.FAILED, status_message="Crashed: ...", name="old-failed")
    page = operator_client.get(f"/deployments/{failed.pk}/").content.decode()
    assert 'data-action="delete"' in page
    answer = operator_client.post(f"/deployments/{failed.pk}/delete/")
    assert answer.status_code == 302 and answer.url == "/deployments/" and not Deployment.objects.filter(pk=failed.pk).exists()
    serving = DeploymentFactory(model=model, node=node, status=S.READY, name="serving", port=9001)
    assert 'data-action="delete"' not in operator_client.get(f"/deployments/{serving.pk}/").content.decode()
    operator_client.post(f"/deployments/{serving.pk}/delete/")
    assert Deployment.objects.get(pk=serving.pk).status == S.READY


def test_a_redeploy_forgets_the_previous_starts_smoke_reply(model, node, sent_tasks):
    """During a redeploy the page showed the previous start's smoke reply (and its status message the old one)."""
    from deployments.services import deploys

    d = DeploymentFactory(model=model, node=node, status=S.READY, smoke={"reply": "Paris.", "latency_s": 0.4}, port=9002,
                          engine_args={"tensor-parallel-size": 1})
    d.gpus.set(node.gpus.filter(index__in=[0]))
    deploys.deployment_redeploy(d)
    d.refresh_from_db()
    assert d.status == S.QUEUED and d.smoke == {}
