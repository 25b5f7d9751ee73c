"""A persisted multi-node deployment's worker ranks leave their restarts to systemd, as a persisted head does
(deployments/node/units.py): a rank whose unit starts after the agent, or whose engine crashed, waits in loading
and is adopted once its unit's engine carries the marker; only a unit systemd gave up on, or one that never
started the engine in time, fails the deployment (and the rank's unit is disabled then).

systemd is the double in tests/faults/systemd (systemctl's command line and semantics); a unit's engine is a
`sleep` carrying the marker, as the unit's Environment= sets it for the real one."""
import os
import signal
import subprocess
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from django.utils import timezone

from deployments.host import ownership, systemd
from deployments.models import Deployment, DeploymentRank
from deployments.node import ranks, units
from plumbing import queue
from tests.deployments.test_multinode import _node
from tests.factories import DeploymentFactory
from tests.helpers import marked

pytestmark = pytest.mark.django_db
DOUBLE = Path(__file__).parent.parent / "faults" / "systemd"
UNIT = "vllm-kimi.rank1.service"
# Its own marker per process: engines are found by marker host-wide, and another test worker (or run) runs this file
# at the same time.
MARKER = f"7.{uuid.uuid4().hex}"


@pytest.fixture
def systemctl(tmp_path, monkeypatch):
    """The systemctl double on PATH, its units and state under tmp_path; every unit stopped at the end."""
    units_dir = tmp_path / "units"
    units_dir.mkdir()
    monkeypatch.setenv("PATH", f"{DOUBLE}:{os.environ['PATH']}")
    monkeypatch.setenv("SYSTEMD_UNIT_PATH", str(units_dir))
    monkeypatch.setenv("SYSTEMCTL_DOUBLE_STATE", str(tmp_path / "state"))
    monkeypatch.setattr(systemd, "RESTART_SEC", 0.2)
    text = systemd.render_unit(description="rank 1 of kimi", argv=["/bin/sleep", "300"], log_path=str(tmp_path / "rank.log"),
                               env={ownership.MARKER_VAR: MARKER, ownership.ROLE_VAR: "engine"})
    (units_dir / UNIT).write_text(text)
    systemd.systemctl("daemon-reload")
    yield units_dir
    subprocess.run(["systemctl", "stop", UNIT], timeout=30, check=False)


def _show() -> dict:
    return dict(line.split("=", 1) for line in systemd.systemctl("show", "-p", "MainPID,ActiveState,NRestarts", UNIT).split())


def _main_running() -> int:
    """The unit's MainPID once it shows the marker: `systemctl start` (Type=simple) returns once the main process is
    forked, and its environment, the proof that it is the rank's engine, reads empty until its exec is done."""
    return marked(int(_show()["MainPID"]), MARKER)


def _ready(pid=None):
    """A ready persisted deployment on gpu-a whose rank 1 runs on gpu-b (under UNIT), its engine `pid`."""
    head, worker = _node("gpu-a"), _node("gpu-b")
    d = DeploymentFactory(name="kimi", node=head, status=Deployment.Status.READY, pid=os.getpid(),
                          marker="7.head-marker", systemd_unit="vllm-kimi.service", master_port=29500)
    rank = DeploymentRank.objects.create(deployment=d, node=worker, rank=1, gpu_indices=[0, 1], state="running",
                                         pid=pid or 999_999_999, pgid=pid, marker=MARKER,
                                         pid_create_time=psutil.Process(pid).create_time() if pid else None)
    return d, worker, rank


def _watched(rank, worker, passes=1):
    for _ in range(passes):
        ranks.ranks_watch(worker.pk)
    rank.refresh_from_db()
    return rank


def _lost(sent_tasks) -> list:
    """(args, queue) of each deployment_rank_lost sent to the head's node (it fails the whole deployment there)."""
    return [(s.args, s.queue) for s in sent_tasks.commit().of("deployments.deployment_rank_lost")]


def test_a_rank_whose_unit_starts_after_the_agent_waits_and_is_adopted_while_the_deployment_stays_ready(systemctl, sent_tasks):
    systemd.systemctl("enable", UNIT)  # enabled for the boot, not started yet: the agent came up first
    d, worker, rank = _ready()
    assert ranks.ranks_reconcile(worker) == {"adopted": [], "failed": [], "waiting": [str(rank)]}
    rank.refresh_from_db()
    assert (rank.state, rank.pid, rank.marker) == ("loading", None, MARKER) and UNIT in rank.message
    assert _watched(rank, worker).state == "loading"  # still to be started: it waits

    subprocess.run(["systemctl", "__boot"], check=True, timeout=30)
    main = _main_running()
    assert _watched(rank, worker).pid == main  # adopted: the unit's engine, proven by its marker
    assert (_watched(rank, worker).state, rank.message) == ("running", "")  # the head is ready: so is the rank
    assert _lost(sent_tasks) == []
    assert Deployment.objects.get(pk=d.pk).status == "ready"
    assert {"unit_restart@gpu-b", "adopted@gpu-b"} <= set(d.events.values_list("step", flat=True))


def _dead(pid: int) -> bool:
    """Gone or a zombie; reaped between two looks counts as gone (CI: NoSuchProcess after pid_exists said yes)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_crashed_rank_is_restarted_once_by_its_unit_and_adopted_while_the_deployment_stays_ready(systemctl, sent_tasks):
    systemd.systemctl("enable", "--now", UNIT)
    first = _main_running()
    d, worker, rank = _ready(pid=first)
    assert _watched(rank, worker).state == "running"

    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _dead(first) and time.monotonic() < deadline:
        time.sleep(0.02)
    rank = _watched(rank, worker)
    assert (rank.state, rank.pid) == ("loading", None) and "systemd starts it again" in rank.message
    assert _lost(sent_tasks) == []  # the deployment is not failed: systemd owns the restart

    deadline = time.monotonic() + 10
    while not (int(_show()["MainPID"]) not in (0, first) and _show()["ActiveState"] == "active"):
        assert time.monotonic() < deadline, _show()
        time.sleep(0.05)
    restarted = _main_running()
    rank = _watched(rank, worker, passes=2)
    assert (rank.state, rank.pid) == ("running", restarted) and _show()["NRestarts"] == "1"
    assert _lost(sent_tasks) == []
    assert Deployment.objects.get(pk=d.pk).status == "ready"


def test_a_rank_whose_unit_systemd_gave_up_on_fails_the_deployment_and_stays_disabled(systemctl, sent_tasks):
    d, worker, rank = _ready()  # the unit is installed but neither running nor enabled: nothing will start it
    assert ranks.ranks_reconcile(worker)["failed"] == [str(rank)]
    assert _lost(sent_tasks) == [([d.pk, rank.pk], queue.control_queue(d.node.queue))]

    sent_tasks.clear()
    DeploymentRank.objects.filter(pk=rank.pk).update(state="loading", pid=None, marker=MARKER)  # it was waiting
    rank = _watched(rank, worker)
    assert rank.state == "failed" and f"{UNIT} is inactive (disabled)" in rank.message
    assert _lost(sent_tasks) == [([d.pk, rank.pk], queue.control_queue(d.node.queue))]


def test_a_rank_whose_unit_never_starts_the_engine_in_time_fails_the_deployment(systemctl, sent_tasks):
    systemd.systemctl("enable", UNIT)
    d, worker, rank = _ready()
    ranks.ranks_reconcile(worker)
    DeploymentRank.objects.filter(pk=rank.pk).update(updated=timezone.now() - timedelta(seconds=units.UNIT_WAIT_S + 1))
    rank = _watched(rank, worker)
    assert rank.state == "failed" and f"did not start the engine within {units.UNIT_WAIT_S:.0f} s" in rank.message
    assert _lost(sent_tasks) == [([d.pk, rank.pk], queue.control_queue(d.node.queue))]
    assert _show()["ActiveState"] == "inactive" and systemd.unit_status(UNIT).enabled == "disabled"  # never at a boot
