"""One engine lifecycle (deployments/node/lifecycle.py) for heads and ranks: adoption only of the engine itself,
guarded rank states. Real processes (`sleep` stands in for an engine and for a Ray head)."""
import os
import signal
import sys
from pathlib import Path

import pytest

from deployments.host import ownership, processes
from deployments.models import Deployment, DeploymentRank
from deployments.node import lifecycle, reconcile
from plumbing.states import InvalidTransition
from tests.conftest import wait_until
from tests.factories import DeploymentFactory, NodeFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status


def _start(marker: str, role: str, log: Path) -> int:
    """A process carrying the deployment's marker in the role given, in a group of its own (as engines run)."""
    handle = processes.launch(processes.EngineSpec(argv=[sys.executable, "-c", "import time; time.sleep(60)"],
                                             env=lifecycle.marked_env({}, marker, role), log_path=log))
    return handle.pid


def test_an_agent_restart_while_a_ray_cluster_forms_never_adopts_the_ray_head_as_the_engine(tmp_path):
    """The Ray head carries the deployment's marker too; with no engine launched yet the plan was interrupted:
    the deployment fails and the Ray head is stopped, instead of being followed as if it were the engine."""
    d = DeploymentFactory(status=S.STARTING, master_port=29500, engine_args={"distributed-executor-backend": "ray"})
    d.marker = ownership.new_marker(d.pk)
    Deployment.objects.filter(pk=d.pk).update(marker=d.marker)
    head = _start(d.marker, lifecycle.RAY, tmp_path / "ray.log")
    try:
        assert not lifecycle.adopt(d)
        report = reconcile.deployments_reconcile(d.node)
        d.refresh_from_db()
        assert report["failed"] == [d.name] and d.status == S.FAILED and d.pid is None
        assert not processes.alive(head)
    finally:
        _kill(head)


def test_an_engine_whose_pid_never_reached_the_row_is_adopted_by_its_marker_and_create_time(tmp_path):
    d = DeploymentFactory(status=S.LOADING)
    d.marker = ownership.new_marker(d.pk)
    Deployment.objects.filter(pk=d.pk).update(marker=d.marker)
    head = _start(d.marker, lifecycle.RAY, tmp_path / "ray.log")
    pid = _start(d.marker, lifecycle.ENGINE, tmp_path / "engine.log")
    try:
        # The engine runs with its marker (as one does by the time an agent restarts): on a busy machine the
        # new process shows its environment a moment after launch returns (it failed once in CI here).
        wait_until(lambda: pid in ownership.engines_marked(d.marker), timeout=10, message="the engine's marker")
        assert lifecycle.adopt(d)
        d.refresh_from_db()
        assert d.pid == pid and d.pgid == pid and d.pid_create_time == pytest.approx(lifecycle.create_time(pid))
        assert lifecycle.running(d)
        Deployment.objects.filter(pk=d.pk).update(pid_create_time=d.pid_create_time - 60)  # a reused PID (a minute apart)
        d.refresh_from_db()
        assert not lifecycle.running(d)
    finally:
        _kill(head)
        _kill(pid)


def test_a_rank_moves_only_along_its_plan_and_a_stopped_rank_only_back_to_pending():
    node = NodeFactory()
    d = DeploymentFactory(master_port=29500)
    r = DeploymentRank.objects.create(deployment=d, node=node, rank=1)
    r.transition(DeploymentRank.State.PREPARING)
    with pytest.raises(InvalidTransition):
        r.transition(DeploymentRank.State.LOADING)  # skipping the pre-flight and the head's go
    r.transition(DeploymentRank.State.STOPPING)
    with pytest.raises(InvalidTransition):
        r.transition(DeploymentRank.State.PREPARED)
    r.transition(DeploymentRank.State.STOPPED)
    assert DeploymentRank.sources(DeploymentRank.State.PREFLIGHT) == {DeploymentRank.State.PREPARED}
    r.transition(DeploymentRank.State.PENDING)


def _kill(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
