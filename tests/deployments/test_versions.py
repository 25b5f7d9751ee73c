"""Deploy versions (deployments/versions.py) and the rollback (services/rollbacks.py): each deploy and redeploy
recorded as resolved and settled by how its start ended, the diff between two, the known good one, and a rollback
that deploys it exactly, from the API, the page and panelctl. The real engine's side is
tests/e2e/test_rollback_real.py."""
import pytest

from deployments import versions
from deployments.models import Deployment, DeployVersion
from deployments.node import crashes
from deployments.services import deploys, rollbacks
from panelctl import cli
from plumbing.errors import ServiceError
from tests.factories import GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status
ADMIN = lambda: UserFactory(role="admin")  # noqa: E731 - HF_TOKEN is the admin's to set
FLAGS = ["--tensor-parallel-size", "--max-model-len", "--max-num-seqs", "--served-model-name", "--port", "--host"]


@pytest.fixture
def node(tmp_path):
    node = NodeFactory(name="gpu-01", model_store=str(tmp_path), engine_flags=FLAGS, engine_version="0.32.0")
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * 10**9)
    return node


@pytest.fixture
def deployment(node, tmp_path, sent_tasks):
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    return deploys.deployment_create(model=copy.model, node=node, gpu_indices=[0, 1], port=8000, name="kimi",
                                     engine_args={"tensor-parallel-size": 2, "max-num-seqs": 64},
                                     env={"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_secret_value"}, user=ADMIN())


def _end(d: Deployment, status: str, message: str = "") -> Deployment:
    """The start ends as the node's plan ends it: the row moves step by step and is saved at each."""
    row = Deployment.objects.get(pk=d.pk)
    path = [S.PREPARING, S.STARTING, S.LOADING, S.READY] if status == S.READY else [status]
    for to in path:
        row.transition(to, message if to == status else "")
        row.save()
    return row


def test_every_deploy_and_redeploy_is_a_version_settled_by_how_its_start_ended(deployment):
    v1 = DeployVersion.objects.get(deployment=deployment)
    assert (v1.number, v1.reason, v1.outcome) == (1, "deploy", "pending")
    assert v1.request["env"] == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "••••••"}  # never a secret's value
    assert v1.request["gpu_indices"] == [0, 1] and v1.request["engine_args"]["max-num-seqs"] == 64
    _end(deployment, S.READY)
    v1.refresh_from_db()
    assert v1.outcome == "ready" and v1.ready_seconds is not None and v1.ended
    deploys.deployment_redeploy(Deployment.objects.get(pk=deployment.pk), engine_args={"tensor-parallel-size": 2,
                                "max-num-seqs": 16}, env={"NCCL_DEBUG": "INFO", "NCCL_PROTO": "LL", "HF_TOKEN": "••••••"}, user=ADMIN())
    queued = deployment.events.filter(step="queued").order_by("pk").last().message
    assert queued == "Redeploy requested (version 2): --max-num-seqs 64 → 16; NCCL_PROTO=LL added."
    _end(deployment, S.FAILED, "The engine exited while it loaded: CUDA out of memory.")
    v2 = DeployVersion.objects.get(deployment=deployment, number=2)
    assert (v2.outcome, v2.outcome_message) == ("failed", "The engine exited while it loaded: CUDA out of memory.")
    assert versions.known_good(deployment).number == 1
    listed = versions.listed(deployment)
    assert [(v["number"], v["known_good"], v["changes"]) for v in listed] == [
        (2, False, ["--max-num-seqs 64 → 16", "NCCL_PROTO=LL added"]), (1, True, [])]


def test_a_start_whose_end_was_never_seen_is_superseded_by_the_next(deployment):
    Deployment.objects.filter(pk=deployment.pk).update(status=S.READY)  # an update: no save, no settling
    deploys.deployment_redeploy(Deployment.objects.get(pk=deployment.pk))
    assert list(DeployVersion.objects.filter(deployment=deployment).values_list("number", "outcome")) == [
        (2, "pending"), (1, "stopped")]


def test_the_diff_says_each_change_in_words():
    old = {"engine_args": {"max-num-seqs": 64, "enforce-eager": True}, "env": {"NCCL_PROTO": "Simple"},
           "gpu_indices": [0, 1], "engine": "0.32.0", "port": 8000}
    new = {"engine_args": {"max-num-seqs": 16, "enable-expert-parallel": True}, "env": {}, "gpu_indices": [0, 1, 2, 3],
           "engine": "0.33.0", "port": 8001}
    assert versions.diff(old, new) == ["--enable-expert-parallel added", "--enforce-eager removed",
                                       "--max-num-seqs 64 → 16", "NCCL_PROTO removed", "GPUs 0,1 → 0,1,2,3",
                                       "engine 0.32.0 → 0.33.0", "port 8000 → 8001"]


def test_a_rollback_deploys_the_known_good_version_exactly(deployment, sent_tasks):
    _end(deployment, S.READY)
    deploys.deployment_redeploy(Deployment.objects.get(pk=deployment.pk), gpu_indices=[0, 1, 2, 3],
                                engine_args={"tensor-parallel-size": 4, "max-num-seqs": 16}, env={"HF_TOKEN": "••••••"}, user=ADMIN())
    _end(deployment, S.FAILED, "Crashed")
    d = rollbacks.deployment_rollback(Deployment.objects.get(pk=deployment.pk))
    assert d.status == S.QUEUED and d.gpu_indices == [0, 1]
    assert d.engine_args == {"tensor-parallel-size": 2, "max-num-seqs": 64, "served-model-name": d.served_model_name}
    assert d.env == {"NCCL_DEBUG": "INFO", "HF_TOKEN": "hf_secret_value"}  # the secret's value kept, not the mask
    assert [s.name for s in sent_tasks.commit()] == ["deployments.deployment_run"] * 3  # deploy, redeploy, rollback
    v3 = DeployVersion.objects.get(deployment=d, number=3)
    assert v3.reason == "rollback to version 1" and v3.request == {**DeployVersion.objects.get(deployment=d, number=1)
                                                                     .request}
    assert d.events.filter(step="queued").order_by("pk").last().message == (
        "Rollback to version 1 (version 3): --max-num-seqs 16 → 64; --tensor-parallel-size 4 → 2; NCCL_DEBUG=INFO added; "
        "GPUs 0,1,2,3 → 0,1.")


def test_a_rollback_is_refused_without_a_known_good_version_or_a_secret_no_longer_stored(deployment):
    with pytest.raises(ServiceError, match="kimi has no known good version") as refused:
        rollbacks.deployment_rollback(deployment)
    assert refused.value.code == "no_known_good"
    _end(deployment, S.READY)
    deploys.deployment_redeploy(Deployment.objects.get(pk=deployment.pk), env={"NCCL_DEBUG": "INFO"}, user=ADMIN())
    with pytest.raises(ServiceError, match="Version 1 set the secret HF_TOKEN, whose value is no longer stored"):
        rollbacks.deployment_rollback(Deployment.objects.get(pk=deployment.pk), 1)
    with pytest.raises(ServiceError, match="kimi has no version 9"):
        rollbacks.deployment_rollback(deployment, 9)


def test_an_automatic_restart_and_an_advised_retry_are_versions_too(deployment):
    row = _end(deployment, S.FAILED, "Crashed: exit 1")
    assert crashes.requeue(row, "advised_retry", engine_args={**row.engine_args, "gpu-memory-utilization": "0.85"})
    v2 = DeployVersion.objects.get(deployment=deployment, number=2)
    assert v2.reason == "retry with the advised setting" and v2.request["engine_args"]["gpu-memory-utilization"] == "0.85"


def test_the_api_the_page_and_panelctl_list_versions_and_roll_back(deployment, api, operator_client, monkeypatch,
                                                                    capsys):
    _end(deployment, S.READY)
    deploys.deployment_redeploy(Deployment.objects.get(pk=deployment.pk), engine_args={"tensor-parallel-size": 2,
                                "max-num-seqs": 16}, env={"NCCL_DEBUG": "INFO", "HF_TOKEN": "••••••"}, user=ADMIN())
    _end(deployment, S.FAILED, "The engine exited while it loaded.")
    listed = api.get(f"/api/deployments/{deployment.pk}/versions/").json()["results"]
    assert [(v["number"], v["outcome"], v["known_good"]) for v in listed] == [(2, "failed", False), (1, "ready", True)]
    assert "hf_secret_value" not in str(listed)
    page = operator_client.get(f"/deployments/{deployment.pk}/").content.decode()
    assert "Roll back to known good (v1)" in page and "<code>--max-num-seqs 64 → 16</code>" in page
    assert 'class="badge ready">known good</span>' in page
    answer = operator_client.post(f"/deployments/{deployment.pk}/rollback/")
    assert answer.status_code == 302 and Deployment.objects.get(pk=deployment.pk).status == S.QUEUED
    assert DeployVersion.objects.get(deployment=deployment, number=3).reason == "rollback to version 1"
    refused = api.post(f"/api/deployments/{deployment.pk}/rollback/", {"version": 1}, format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "busy"  # queued: in flight

    asked = []

    class Panel:
        def __init__(self, *a):
            pass

        def get(self, path, **params):
            if path == "deployments/":
                return {"results": [{"id": deployment.pk}]}
            if path.endswith("/versions/"):
                return {"results": listed}
            return {"id": deployment.pk, "name": "kimi", "status": "failed"}

        def post(self, path, body=None, key=None):
            asked.append((path, body))
            return {"id": deployment.pk, "name": "kimi", "status": "queued"}

    monkeypatch.setattr(cli, "Panel", Panel)
    assert cli.main(["--url", "http://x", "--token", "t", "versions", "kimi"]) == 0
    out = capsys.readouterr().out
    assert "v2  " in out and "    --max-num-seqs 64 → 16" in out and "[known good]" in out
    assert cli.main(["--url", "http://x", "--token", "t", "rollback", "kimi", "--version", "1"]) == 0
    assert asked == [(f"deployments/{deployment.pk}/rollback/", {"version": 1})]
