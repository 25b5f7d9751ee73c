"""Persisted (unit-backed) engines: systemd starts them at boot and again after a crash (Restart=on-failure,
RestartSec=systemd.RESTART_SEC); the panel starts a unit only when it is enabled and not running (the engine that
was serving when it was persisted ran outside it, so nothing else would), and never kills an engine it can prove is
the deployment's.

Whenever a persisted engine is not the one the row names (a reboot, a crash, an agent that restarted), the
agent asks systemd for the unit's MainPID and adopts that process when it carries the deployment's marker
(the unit's Environment= sets it): the deployment shows "loading" and the load is followed to "ready" as any
load is (a "load" step in its history). While systemd is still to start it (restarting, or enabled for a boot
not yet done) the deployment waits in "loading" with no PID, for at most UNIT_WAIT_S; a unit systemd gave up on,
or one no longer enabled, fails the deployment, and fail() disables the unit, so nothing comes back as an orphan.
A worker rank of a persisted multi-node deployment runs under a unit of its own node and follows the same rule
(ranks.py asks `unit_coming`).

With PANEL_ENGINE_RUNTIME=docker (compose) what keeps a persisted engine is its own container, kept with Docker's
restart policy, in systemd's place: `systemd_unit` then reads "container:<name>" and host/keepers.py answers for it.
"""
import logging
import os
import time

from deployments.dispatch import node_enqueue
from deployments.host import keepers, processes, systemd
from deployments.models import Deployment, EngineProcess
from deployments.node import lifecycle
from deployments.node.steps import Aborted, fail, move
from deployments.timeline import deployment_event

log = logging.getLogger(__name__)
S = Deployment.Status
UNIT_WAIT_S = float(os.environ.get("ENGINE_UNIT_WAIT_S", "600"))  # a boot, or systemd's RestartSec, well within


def _status(p: EngineProcess) -> systemd.UnitStatus | None:
    try:
        return keepers.status(lifecycle.unit_of(p))
    except keepers.Error as exc:
        log.warning("%s: cannot read %s: %s", p, lifecycle.unit_of(p), exc)
        return None


def _who(d: Deployment) -> str:
    return "Docker" if keepers.is_container(d.systemd_unit) else "systemd"


def unit_coming(p: EngineProcess) -> tuple[bool, str]:
    """Whether systemd starts the engine of `p` (a head or a worker rank) again by itself, and its unit's state."""
    status = _status(p)
    if status is None:
        return False, f"{lifecycle.unit_of(p)} cannot be read"
    return status.coming, f"{lifecycle.unit_of(p)} is {status.active} ({status.enabled})"


def _clean_shm(d: Deployment) -> None:
    """The /dev/shm files a gone engine left, removed as a halt removes them (those no live process holds); the
    running engine's are recorded again as the crash watch sees them (lifecycle.record_shm)."""
    processes.remove_unused_shm(set(d.shm_files or []))
    lifecycle.save(d, shm_files=[])


def _wait(d: Deployment, why: str) -> None:
    """The engine is gone and systemd starts it again: wait in "loading", the row naming no process (its marker
    kept: the unit's engine carries it, so it is the deployment's and never foreign)."""
    _clean_shm(d)
    lifecycle.save(d, pid=None, pgid=None, pid_create_time=None)
    if d.status == S.READY:
        try:
            move(d, S.LOADING, why)
        except Aborted:
            return
    deployment_event(d, "unit_restart", why.capitalize() + ".")


def _started_if_idle(d: Deployment, status: systemd.UnitStatus | None) -> systemd.UnitStatus | None:
    """A unit enabled but not running (its engine ran outside it since the persist, or the boot has not reached it):
    started now, since nothing else will; the unit's status after."""
    if status is None or (status.active, status.enabled) != ("inactive", "enabled"):
        return status
    try:
        keepers.start(d.systemd_unit)
    except keepers.Error as exc:
        log.warning("%s: cannot start %s: %s", d, d.systemd_unit, exc)
        return status
    deployment_event(d, "unit_start", f"Started {d.systemd_unit}: it was enabled but not running.")
    return _status(d)


def engine_exited(d: Deployment) -> None:
    """The crash watch saw a ready persisted engine gone: systemd restarts it (or the agent starts its unit when
    systemd had not run it yet), the agent adopts it then."""
    status = _started_if_idle(d, _status(d))
    if status is not None and status.coming:
        _wait(d, f"the engine exited; {d.systemd_unit} starts it again ({keepers.restarts_how(d.systemd_unit)})")
        return
    from_unit = f"{d.systemd_unit} is {status.active}" if status else f"{d.systemd_unit} cannot be read"
    fail(d, f"Crashed: the engine exited and {from_unit}; {_who(d)} will not start it again.")


def unit_settle(d: Deployment) -> str:
    """On agent start, a persisted deployment whose recorded engine is not running: "following" (its unit's
    engine adopted, its load followed), "waiting" (systemd is to start it) or "failed"."""
    before = d.pid
    if lifecycle.adopt(d):
        _adopted(d, "the agent restarted and found", new_engine=d.pid != before)
        return "following"
    status = _started_if_idle(d, _status(d))
    if status is not None and status.coming:
        _wait(d, f"waiting for {d.systemd_unit} to start the engine ({status.active}, {status.enabled})")
        return "waiting"
    fail(d, f"The node agent restarted and the engine is not running; {d.systemd_unit} is "
            f"{status.active + ' and ' + status.enabled if status else 'unreadable'}.")
    return "failed"


def _adopted(d: Deployment, how: str, new_engine: bool = True) -> None:
    """The row names the unit's engine now: follow its load to ready (a deployment ready before shows loading)."""
    if new_engine:  # a reboot or a crash the agent was not there to see: the engine before this one left them
        _clean_shm(d)
    if d.status == S.READY:
        try:
            move(d, S.LOADING, f"{_who(d)} started the engine again (PID {d.pid}); following its load")
        except Aborted:
            return
    elif d.status == S.STARTING:
        move(d, S.LOADING)
    deployment_event(d, "adopted", f"{how.capitalize()} the engine {d.systemd_unit} runs (PID {d.pid}, proven by its "
                     "marker); following its load.")
    node_enqueue(d.node, "deployments.deployment_follow", d.pk)


def units_watch(node_id: int, waiting: dict | None = None) -> None:
    """Persisted deployments waiting for systemd to start their engine: adopt it once its MainPID carries the
    marker; fail the deployment when systemd gave up, or after UNIT_WAIT_S."""
    waiting = {} if waiting is None else waiting
    rows = Deployment.objects.select_related("node").filter(node_id=node_id, status__in=(S.STARTING, S.LOADING),
                                                            pid=None).exclude(systemd_unit="").exclude(marker="")
    seen = set()
    for d in rows:
        seen.add(d.pk)
        if lifecycle.driven(d.pk):  # its plan launches the unit's engine right now (a persist switch)
            continue
        since = waiting.setdefault(d.pk, time.monotonic())
        if lifecycle.adopt(d):
            waiting.pop(d.pk, None)
            _adopted(d, f"{_who(d)} started")
            continue
        status = _status(d)
        if status is not None and not status.coming:
            fail(d, f"{d.systemd_unit} is {status.active} ({status.enabled}): {_who(d)} will not start the engine again.")
        elif time.monotonic() - since > UNIT_WAIT_S:
            fail(d, f"{d.systemd_unit} did not start the engine within {UNIT_WAIT_S:.0f} s.")
        else:
            continue
        waiting.pop(d.pk, None)
    for pk in set(waiting) - seen:
        waiting.pop(pk, None)
