"""One engine process's life on its node, for a deployment's head and for a worker rank alike (both are
models.EngineProcess rows): launch it (marked as the panel's), tell whether it still runs and is provably
ours, halt it, and adopt one the agent finds running (after an agent restart, or a systemd unit that
started it again after a reboot or a crash).

What differs between a head, a worker rank and a Ray node is a parameter (the argv, the environment, the
role, the unit), never a copy of these steps."""
import collections
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from deployments.host import containers, door, firewall, keepers, osuser, ownership, processes, processlog, systemd
from deployments.models import Deployment, DeploymentRank, EngineProcess

log = logging.getLogger(__name__)
STOP_TERM_S, STOP_KILL_S = 30.0, 10.0
# Ray's `ray start --block` spends 20-40 s trying to drain its node through a GCS that is going away on
# SIGTERM (measured, Ray 2.60): its processes get a short grace, then SIGKILL (what `ray stop --force` does).
RAY_TERM_S = 3.0
TAIL_LINES = 400
ENGINE, RAY = "engine", "ray"  # ownership.ROLE_VAR: only an "engine" process is ever adopted as the engine


_driven: collections.Counter = collections.Counter()  # deployment id -> plans and follows driving it now
_driven_lock = threading.Lock()


@contextlib.contextmanager
def driving(deployment_id: int):
    """A plan or a follow of this agent process drives the deployment's engine meanwhile: the watchers (a unit's
    engine to adopt, a follow to send) leave it alone, and a second follow of it returns at once. Yields whether
    this caller is the first driving it (False: another thread of this process already is). Counted, so that an
    older plan ending while a newer one of the same deployment runs leaves it driven."""
    with _driven_lock:
        mine = _driven[deployment_id] == 0
        _driven[deployment_id] += 1
    try:
        yield mine
    finally:
        with _driven_lock:
            _driven[deployment_id] -= 1
            if _driven[deployment_id] <= 0:
                del _driven[deployment_id]


def driven(deployment_id: int) -> bool:
    with _driven_lock:
        return _driven[deployment_id] > 0


def deployment_of(p: EngineProcess) -> Deployment:
    return p.deployment if isinstance(p, DeploymentRank) else p


def unit_of(p: EngineProcess) -> str | None:
    """The systemd unit that runs this engine (a persisted deployment: one unit per node), or None."""
    d = deployment_of(p)
    if not d.systemd_unit:
        return None
    return systemd.unit_name(d.name, p.rank) if isinstance(p, DeploymentRank) else d.systemd_unit


def save(p: EngineProcess, **fields) -> None:
    """Set process fields on the object and its row (never the status: that moves through transitions)."""
    for name, value in fields.items():
        setattr(p, name, value)
    type(p).objects.filter(pk=p.pk).update(**fields)


def create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@dataclass
class Launch:
    """What to start: the argv, the environment without the marker (added here, the one place it is), where
    it logs and runs, as whom, and whether it is the engine or a Ray node."""

    argv: list[str]
    env: dict
    log_path: Path
    run_as: osuser.EngineUser | None = None
    cwd: Path | None = None
    role: str = ENGINE
    marker: str = ""  # a Ray deployment's engine carries the marker its Ray head got


def marked_env(env: dict, marker: str, role: str = ENGINE) -> dict:
    """The environment with the marker set last: set by the panel, never inherited, it is what later
    proves the process is this deployment's (and ROLE_VAR what it is to it)."""
    return {**env, ownership.MARKER_VAR: marker, ownership.ROLE_VAR: role}


def launch(p: EngineProcess, spec: Launch, unit_install=None) -> int:
    """Start the process and record it on the row: under its systemd unit when the deployment is persisted
    (`unit_install(argv, env, log_path, cwd) -> main PID`), else as a process group of its own. Returns the PID."""
    marker = spec.marker or ownership.new_marker(deployment_of(p).pk)
    env = marked_env(spec.env, marker, spec.role)
    if port := api_port(p, spec.role):
        door.shut(port, deployment_of(p).node.name)  # before it binds: its routes answer only the agent and gateway
    save(p, marker=marker, log_path=str(spec.log_path))
    unit = unit_of(p)
    if unit and unit_install is not None and not keepers.is_container(unit):
        pid = unit_install(spec.argv, env, str(spec.log_path), spec.cwd)
        save(p, pid=pid, pgid=pgid_of(pid), pid_create_time=create_time(pid))
    else:
        keep = keepers.is_container(unit)  # a persisted engine in a container: its new container is kept in turn
        handle = processes.launch(processes.EngineSpec(argv=spec.argv, env=env, log_path=spec.log_path, cwd=spec.cwd,
                                                 run_as=spec.run_as, keep=keep))
        save(p, pid=handle.pid, pgid=handle.pgid, pid_create_time=handle.create_time)
        if keep and (mine := [c["name"] for c in containers.find(marker) if c["pid"] == handle.pid]):
            save(deployment_of(p), systemd_unit=keepers.of_container(mine[0]))  # (gone already: the follow says why)
    d = deployment_of(p)
    if d.master_port:  # multi-node or Ray: its cluster ports admit only the deployment's nodes (the API server
        firewall.guard(marker, [p.pid], node_addresses(d))  # listens on loopback: the node's gateway is the door)
    return p.pid


def api_port(p: EngineProcess, role: str = ENGINE) -> int | None:
    """The port of the engine's API server (the head's engine; worker ranks and Ray nodes serve none)."""
    return None if isinstance(p, DeploymentRank) or role != ENGINE else p.port


def node_addresses(d: Deployment) -> list[str]:
    """Every node of the deployment, head first: who may reach its cluster ports."""
    return [d.node.address or "127.0.0.1", *(r.node.address or "127.0.0.1" for r in d.ranks.select_related("node"))]


def running(p: EngineProcess) -> bool:
    """The engine leader runs and is provably ours: the marker it was launched with (or its unit's cgroup),
    and the create time recorded for its PID (a reused PID is someone else's)."""
    return bool(p.pid) and processes.alive(p.pid, p.pid_create_time or 0.0) and ownership.pid_owned(
        p.pid, p.marker, unit_of(p))


def still_running(p: EngineProcess, tries: int = 3, wait_s: float = 0.1) -> bool:
    """running(), asked again a few times before an engine counts as gone: right after a launch the process is
    still exec'ing (setpriv, then env, then the engine), and its environment cannot be read for that moment."""
    for attempt in range(tries):
        if running(p):
            return True
        if attempt < tries - 1:
            time.sleep(wait_s)
    return False


class LogFollow:
    """An engine's log followed while it loads, for a head and a worker rank alike: the lines written since the
    last read, fed to the load progress, and the last TAIL_LINES kept."""

    def __init__(self, p: EngineProcess):
        self.p, self.progress, self.offset, self.lines = p, processlog.LoadProgress(), 0, []

    def read(self) -> list[str]:
        """The new complete lines (already fed to the progress)."""
        lines, self.offset = processlog.read_lines(Path(self.p.log_path), self.offset)
        for line in lines:
            self.progress.feed(line)
        if lines:
            self.lines = (self.lines + lines)[-TAIL_LINES:]
        return lines

    @property
    def tail(self) -> str:
        return "\n".join(self.lines)

    def exited(self) -> str | None:
        """Why the engine is gone (its error, else its last line), or None while it still runs and is ours. What it
        wrote after the last read (its error, as it exited) is read first."""
        if still_running(self.p):
            return None
        self.read()
        return self.progress.error or (self.lines[-1] if self.lines else "no output")


def adopt(p: EngineProcess) -> bool:
    """Take a running engine as the row's when the marker proves it: the unit's MainPID for a persisted one
    (systemd started it again after a reboot or a crash: a new PID, the same marker), else the engine
    leader carrying the marker whose PID never reached the row. A Ray node carries the marker too and is
    never taken for the engine. True when the row now names a running engine."""
    if running(p):
        return True
    found = None
    if unit := unit_of(p):
        try:
            status = keepers.status(unit)
        except keepers.Error as exc:
            log.warning("%s: cannot read %s: %s", p, unit, exc)
            status = None
        if status and status.main_pid and ownership.marker_of(status.main_pid) == p.marker:
            found = status.main_pid
    if found is None:
        found = next(iter(ownership.engines_marked(p.marker)), None)
    if found is None:
        return False
    save(p, pid=found, pgid=pgid_of(found), pid_create_time=create_time(found))
    return running(p)


def stop_marked(marker: str) -> list[int]:
    """Stop every process group a process carrying `marker` is in (the panel set it: they are ours): what is
    left once an engine's own group stopped, such as a Ray node's processes (Ray starts its workers in groups
    of their own). Short grace (RAY_TERM_S); returns the PIDs that survived."""
    survivors: list[int] = []
    for _ in range(3):  # a member may fork while its group is being stopped
        groups = {g for g in map(pgid_of, ownership.find(marker)) if g and g not in (os.getpgrp(), os.getsid(0))}
        if not groups:
            firewall.release(marker)  # nothing of it is left: its firewall rules and cgroup go too
            return []
        survivors = [pid for g in groups for pid in processes.stop(g, RAY_TERM_S, STOP_KILL_S).survivors]
    return survivors


@dataclass
class Halted:
    """What a halt did: the stop (None when nothing of ours ran), and a group left alone as not ours."""

    result: processes.StopResult | None
    unproven: int | None = None

    def describe(self) -> str:
        r = self.result
        if r is None:
            return "not running" + (" (its process group was not provably ours; left alone)" if self.unproven else "")
        shm = f", {len(r.shm_removed)} /dev/shm files removed" if r.shm_removed else ""
        return f"{' then '.join(r.signals_sent) or 'already gone'} in {r.seconds:.1f} s{shm}"


def halt(p: EngineProcess, term_s: float = STOP_TERM_S) -> Halted:
    """Stop the process when it is provably ours: its unit first, disabled (a stopped or failed deployment
    must not come back at the next boot), then its whole group, then anything else carrying its marker; its
    /dev/shm files cleaned once nothing survived. A group that cannot be proven ours is never signalled (after
    a reboot or PID reuse it is someone else's). The row then names no process; its log's last lines stay."""
    if unit := unit_of(p):
        keepers.disable(unit, term_s)
    result, unproven = None, None
    pgid = p.pgid
    if not pgid and p.marker:  # launched, but the agent died before it wrote the PID down
        marked = ownership.find(p.marker)
        pgid = pgid_of(marked[0]) if marked else None
    if pgid and ownership.owned(pgid, p.marker, unit):
        shm = processes.shm_files(pgid)
        result = processes.stop(pgid, term_s, STOP_KILL_S)
        processes.remove_unused_shm(shm)
    elif pgid and processes.members(pgid):
        unproven = pgid
    if p.marker and (left := stop_marked(p.marker)) and result:  # e.g. a Ray node's processes
        result.survivors += left
    survived = bool(result and result.survivors)
    if containers.enabled() and not survived:
        try:
            containers.sweep(p.marker, wait_s=5)  # its container, once Docker saw it exit
        except containers.ContainerError as exc:
            log.warning("%s: %s", p, exc)
    if not survived:
        processes.remove_unused_shm(set(p.shm_files or []))
        door.reopen(api_port(p), deployment_of(p).node.name)  # the port leaves the door's set
    tail = "\n".join(processlog.tail(Path(p.log_path), TAIL_LINES)) if p.log_path else p.log_tail
    save(p, pid=None, pgid=None, pid_create_time=None, log_tail=tail,
         **({} if survived else {"shm_files": []}), **({"marker": ""} if not survived else {}))
    return Halted(result, unproven)


def record_shm(p: EngineProcess) -> None:
    """Remember the engine's /dev/shm files while it runs: after a crash nothing names them."""
    if p.pgid and p.marker:
        seen = sorted(set(p.shm_files or []) | processes.shm_files(p.pgid))
        if seen != (p.shm_files or []):
            save(p, shm_files=seen)
