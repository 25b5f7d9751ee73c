"""panelctl tune against the real ASGI server (no engine: nothing is driven, the study stays queued):
count and estimate, start, status, cancel, and the exit codes scripts rely on."""
import json

import pytest

from benchmarks.models import Study
from panelctl import cli
from plumbing import tokens
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory


@pytest.fixture
def panel(live_server_asgi, operator, sent_tasks):
    node = NodeFactory(name="cpu-01", engine_flags=["--max-num-seqs", "--max-model-len"])
    copy = ModelCopyFactory(node=node)
    d = DeploymentFactory(node=node, model=copy.model, status="ready", name="tiny-cpu-01", engine_args={"max-num-seqs": 16})
    return d, ["--url", live_server_asgi, "--token", tokens.issue(operator)]


def test_panelctl_tune_counts_starts_shows_and_cancels_a_study(panel, capsys):
    d, login = panel
    start = [*login, "tune", "start", d.name, "--vary", "NCCL_PROTO=LL,Simple", "--variant", "max-num-seqs=8",
             "--concurrency", "1,16", "--repeats", "2"]
    assert cli.main([*start, "--dry-run", "--json"]) == 0
    preview = json.loads(capsys.readouterr().out)
    assert preview["variants"] == 4 and preview["trials"] == 8
    assert preview["names"] == ["baseline", "--max-num-seqs 8", "NCCL_PROTO=LL", "NCCL_PROTO=Simple"]
    assert not Study.objects.exists()
    assert cli.main([*start, "--json"]) == 0
    study = Study.objects.get()
    assert json.loads(capsys.readouterr().out)["id"] == study.pk and study.workload["levels"] == [1, 16]
    assert cli.main([*login, "tune", "status", str(study.pk)]) == 0
    shown = capsys.readouterr().out
    assert f"Study {study.pk} queued: 0/8 trials" in shown and "NCCL_PROTO=Simple" in shown
    assert cli.main([*start]) == 3  # one study at a time per deployment: a conflict
    assert cli.main([*login, "tune", "start", d.name, "--variant", "max-num-seqz=8"]) == 2
    assert "unknown engine flag --max-num-seqz" in capsys.readouterr().err
    assert cli.main([*login, "tune", "cancel", str(study.pk)]) == 0
    assert Study.objects.get().status == "cancelled"
