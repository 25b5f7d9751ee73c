"""Messages built from engine log lines (status, timeline, rank messages, live lines, the log tail) pass
through the secret masker, also for secrets the panel never knew."""
from unittest import mock

import pytest
from rest_framework.test import APIClient

from deployments import payloads, secrets
from deployments.models import Deployment, DeploymentRank
from deployments.node import plan, ranks, watch
from tests.deployments.test_deploys import FLAGS, FakeHost, host  # noqa: F401 - host: the plan's node, faked at its boundary
from tests.conftest import wait_until
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
API_KEY = "engine-own-api-key-77"  # in no setting of the deployment: the engine got it elsewhere
HF = "hf_" + "Ab1" * 12
BEARER = "eyJhbGciOiJIUzI1NiJ9.payload-part.signature42"
URL_PASSWORD = "pr0xy-pa55word"
SECRETS = (API_KEY, HF, BEARER, URL_PASSWORD)
LEAKY_LOG = (
    f"INFO 12-01 10:00:00 [api_server.py:1] non-default args: {{'model': '/m', 'api_key': ['{API_KEY}'], 'max_num_seqs': 8}}\n"
    f"DEBUG 12-01 10:00:01 [http.py:9] GET https://huggingface.co/api/models/org/m Authorization: Bearer {BEARER}\n"
    f"INFO 12-01 10:00:02 [envs.py:1] HTTPS_PROXY=http://panel:{URL_PASSWORD}@proxy.local:3128\n"
    f"ValueError: the token {HF} has no access to org/m\n")
ORDINARY = [  # vLLM's own lines, left as they are
    "INFO 12-01 10:00:03 [gpu_worker.py:1] Available KV cache memory: 10.5 GiB",
    "INFO 12-01 10:00:03 [kv_cache_utils.py:1] GPU KV cache size: 123,456 tokens",
    "INFO 12-01 10:00:03 [kv_cache_utils.py:1] Maximum concurrency for 2,048 tokens per request: 60.28x",
    "INFO 12-01 10:00:04 [api_server.py:1] non-default args: {'tokenizer_mode': 'auto', 'hf_token': None, 'max_num_batched_tokens': 2048}",
    "KeyError: 'HF_TOKEN'",
    "Loading safetensors checkpoint shards: 50% Completed | 1/2",
]


def _leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_the_masker_hides_each_kind_of_credential_and_leaves_ordinary_lines_alone():
    masked = secrets.redact_deployment(None, LEAKY_LOG)
    assert _leaks(masked) == [] and masked.count(secrets.MASK) == 4, masked
    assert "Authorization: Bearer " + secrets.MASK in masked and f"http://panel:{secrets.MASK}@proxy.local" in masked
    for line in ["vllm serve /m --api-key s3cr3t-v --port 8000", "VLLM_API_KEY=s3cr3t-v", '{"X_PASSWORD": "s3cr3t-v"}',
                 "Authorization: Basic dXNlcjpzM2NyM3Qtdg==", "postgres://panel:s3cr3t-v@db/panel"]:
        assert "s3cr3t-v" not in secrets.scrub(line) and "dXNlcjpz" not in secrets.scrub(line), line
    assert [secrets.scrub(line) for line in ORDINARY] == ORDINARY
    assert secrets.scrub(secrets.scrub(LEAKY_LOG)) == secrets.scrub(LEAKY_LOG)


def test_an_engine_that_exits_while_loading_leaves_no_secret_of_its_log_in_any_message(host, tmp_path, viewer):
    node = NodeFactory(model_store=str(tmp_path), engine_flags=sorted(FLAGS))
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    d = DeploymentFactory(node=node, model=copy.model, port=8000, status=Deployment.Status.QUEUED)

    def launch_then_exit(spec):
        handle = FakeHost.launch(host, spec)
        spec.log_path.write_text(LEAKY_LOG)
        host.alive = False
        return handle

    host.mocks["processes.launch"].side_effect = launch_then_exit
    with mock.patch.object(payloads, "send_log_lines", autospec=True) as send:
        plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == Deployment.Status.FAILED and "The engine exited while loading: ValueError" in d.status_message
    events = " | ".join(d.events.values_list("message", flat=True))
    sent = "\n".join(line for call in send.call_args_list for line in call.args[1])
    client = APIClient()
    client.force_authenticate(viewer)
    shown = {"status": d.status_message, "events": events, "live lines": sent,
             "logs API": client.get(f"/api/deployments/{d.pk}/logs/").content.decode(),
             "deployment API": client.get(f"/api/deployments/{d.pk}/").content.decode()}
    assert {where: _leaks(text) for where, text in shown.items() if _leaks(text)} == {}
    assert secrets.MASK in d.status_message and "Bearer " + secrets.MASK in sent


def test_a_crash_message_quoting_the_last_log_lines_is_masked(host, tmp_path):
    log = tmp_path / "crash.log"
    log.write_text(LEAKY_LOG)
    d = DeploymentFactory(status=Deployment.Status.READY, pid=4242, pgid=4242, log_path=str(log), auto_restart=False)
    host.alive = False
    watch.deployments_watch(d.node_id, {})
    d.refresh_from_db()
    failed = d.events.get(step="failed").message
    assert d.status == Deployment.Status.FAILED and failed.startswith("Crashed:") and "the token" in failed
    assert _leaks(failed) == [] and _leaks(d.status_message) == []


def test_a_worker_ranks_message_from_its_log_is_masked():
    d = DeploymentFactory(status=Deployment.Status.LOADING)
    r = DeploymentRank.objects.create(deployment=d, node=NodeFactory(), rank=1, gpu_indices=[0])
    ranks._note(r, DeploymentRank.State.FAILED, f"the rank's engine exited: {LEAKY_LOG.splitlines()[-1]}")
    r.refresh_from_db()
    assert _leaks(r.message) == [] and r.message.endswith(f"the token {secrets.MASK} has no access to org/m")


def test_a_foreign_processs_command_line_is_shown_without_its_secrets():
    import subprocess
    import sys

    from deployments.host import ownership

    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--api-key", API_KEY,
                                 f"--hf-token={HF}"])
    try:  # Popen returns once the child is forked: its command line is the stranger's once it has exec'd
        command = wait_until(lambda: (c := ownership.describe(stranger.pid)["command"]) and "time.sleep" in c and c,
                             timeout=10, message="the stranger's exec")
    finally:
        stranger.kill()
        stranger.wait()
    assert "time.sleep(30)" in command and _leaks(command) == [], command
