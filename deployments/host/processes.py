"""vLLM engine processes on a host: launch, find the group's members, stop them, check a port.

The argv and flags: host/serveargv.py; the log: host/processlog.py; health: host/vllm.py.

The only module that spawns or signals engine processes. Plain Python, no Django.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from deployments.host import containers, osuser, processenv
from deployments.host.errors import HostError

SHM_DIR = Path("/dev/shm")


class EngineError(HostError):
    """An engine could not be launched, inspected or stopped."""


@dataclass
class EngineSpec:
    """Everything needed to start one engine process; env is what the panel sets (processenv.deployment_env)."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None
    # Who the engine runs as (osuser.current() for deployments); None: the agent's own user.
    run_as: osuser.EngineUser | None = None
    keep: bool = False  # with PANEL_ENGINE_RUNTIME=docker: a persisted engine, its container kept (containers.keep)


@dataclass
class EngineHandle:
    """A launched engine: leader pid and its process group (== its session)."""

    pid: int
    pgid: int
    create_time: float = 0.0


@dataclass
class StopResult:
    """What stop() did: signals sent, time taken, pids still alive, /dev/shm files removed."""

    signals_sent: list[str]
    seconds: float
    survivors: list[int]
    shm_removed: list[str] = field(default_factory=list)


# --- processes --------------------------------------------------------------------------------


def popen_args(spec: EngineSpec) -> dict:
    """subprocess.Popen's arguments for `spec`: its user, groups and no_new_privs, its secret flags moved
    from the command line into the environment (processenv.secret_argv), the allowlisted environment."""
    user = spec.run_as
    try:
        argv, secret_env = processenv.secret_argv(list(spec.argv))
    except processenv.SecretFlagError as exc:
        raise EngineError(str(exc), permanent=True) from exc
    env = processenv.engine_environ({**spec.env, **secret_env}, user_env=user.environ() if user else None)
    prefix = osuser.argv_prefix()  # setpriv execs the engine in place: same PID, the engine's cmdline
    return {"args": prefix + argv, "env": env, "cwd": spec.cwd, "preexec_fn": None if prefix else osuser.no_new_privs,
            **(user.popen_kwargs() if user else {})}


def _check_reachable(spec: EngineSpec, env: dict) -> None:
    """Say which file the engine's user cannot reach, before a bare "Permission denied" from exec."""
    exe = shutil.which(spec.argv[0], path=env.get("PATH", os.defpath))
    if exe is None:
        raise EngineError(f"cannot start {spec.argv[0]}: not found", permanent=True)
    user = spec.run_as
    if user is None or not user.separate:
        return
    for path, want in ((exe, "x"), *(((spec.cwd, "r"),) if spec.cwd else ())):
        if not osuser.can_reach(user, path, want):
            raise EngineError(f"the engine user {user.name} cannot {'run' if want == 'x' else 'read'} {path}: make it and "
                              f"its parent folders readable by {user.name} (group or others), or see PANEL_ENGINE_USER "
                              "in docs/security.md", permanent=True)


def launch(spec: EngineSpec) -> EngineHandle:
    """Start the engine in a new session as spec.run_as; stdout and stderr are appended to spec.log_path,
    a file the agent opens (0600): the engine writes to it through the descriptor it inherits. With
    PANEL_ENGINE_RUNTIME=docker the same engine starts as a container of its own (host/containers.py)."""
    args = popen_args(spec)
    _check_reachable(spec, args["env"])
    try:  # PANEL_ENGINE_RUNTIME=docker: a container of its own, outside the agent's cgroup
        pid = containers.start(args, spec.log_path, keep=spec.keep) if containers.enabled() else None
    except containers.ContainerError as exc:
        raise EngineError(str(exc), permanent=exc.permanent) from exc
    if pid is not None:
        return EngineHandle(pid=pid, pgid=pid, create_time=_create_time(pid))
    log_path = Path(spec.log_path)
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with open(fd, "ab") as log:
        try:
            proc = subprocess.Popen(
                **args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise EngineError(f"cannot start {spec.argv[0]}: {e}", permanent=True) from e
    for pid in list(_CHILDREN):  # as subprocess's own clean-up reaps ended children at each start, keeping how they ended
        _reap(pid)
    _CHILDREN[proc.pid] = proc
    return EngineHandle(pid=proc.pid, pgid=proc.pid, create_time=_create_time(proc.pid))


def _create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


# The engines this process started, kept so that subprocess's own clean-up of forgotten children never reaps one
# (and takes its exit status) before the crash watch asks; and the exit codes of those that ended (exits.py).
_CHILDREN: dict[int, subprocess.Popen] = {}
_EXITS: dict[int, int] = {}


def _reap(pid: int) -> None:
    """Wait for `pid` without blocking when it is our own child (an exited one stays a zombie, and looks alive, until
    waited for), keeping how it ended."""
    if (proc := _CHILDREN.get(pid)) is not None:
        code = proc.poll()
    else:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        code = os.waitstatus_to_exitcode(status) if done else None
    if code is None:
        return
    _CHILDREN.pop(pid, None)
    if len(_EXITS) > 1000:  # an agent running for months: the oldest are long reported
        for old in list(_EXITS)[:500]:
            del _EXITS[old]
    _EXITS[pid] = code


def exit_code(pid: int) -> int | None:
    """How `pid` ended, as Popen.returncode says it (-N: signal N), when this process started it and it has ended;
    None otherwise (still running, started by another agent process, or a unit's)."""
    _reap(pid)
    return _EXITS.get(pid)


# How far a process's start, as read now, may be from the one recorded for it. psutil reads it as wall-clock time:
# /proc/stat's boot time (whole seconds) plus the ticks since boot, and that boot time moves when the clock is stepped
# (a step of a fraction of a second near its boundary moves it by one). Another process on the same PID within that
# slack would need the kernel to hand out every other PID (pid_max, 32,768 at the least) in those seconds.
START_SLACK_S = 5.0


def same_start(read: float, recorded: float) -> bool:
    """The start read now is the recorded one: the same process, across a step of the wall clock."""
    return abs(read - recorded) <= START_SLACK_S


def alive(pid: int, create_time: float = 0.0) -> bool:
    """True while `pid` runs (not a zombie); a create_time guards against pid reuse."""
    _reap(pid)
    try:
        proc = psutil.Process(pid)
        if create_time and not same_start(proc.create_time(), create_time):
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def command_line(pid: int) -> list[str]:
    """The process's argv ([] when it is gone or not readable)."""
    try:
        return psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def members(pgid: int) -> list[int]:
    """Live pids in process group or session `pgid` (zombies excluded)."""
    found = []
    for pid in psutil.pids():
        try:
            if pgid not in (os.getpgid(pid), os.getsid(pid)):
                continue
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


def _shm_held(pid: int) -> list[tuple[str, int]]:
    """(path, inode) of each /dev/shm file process `pid` holds open or maps; a path unlinked since reads
    "… (deleted)". Shared memory is often mmap'd and its fd closed: /proc/pid/maps still names it."""
    held = []
    proc_dir = f"/proc/{pid}"
    try:
        for fd in os.listdir(f"{proc_dir}/fd"):
            try:
                target = os.readlink(f"{proc_dir}/fd/{fd}")
                if target.startswith(f"{SHM_DIR}/"):
                    held.append((target, os.stat(f"{proc_dir}/fd/{fd}").st_ino))
            except OSError:
                continue
        with open(f"{proc_dir}/maps") as maps:
            for line in maps:
                idx = line.find(f" {SHM_DIR}/")
                if idx != -1:
                    held.append((line[idx + 1 :].rstrip("\n"), int(line.split(None, 5)[4])))
    except (OSError, ValueError, IndexError):
        pass
    return held


def _shm_paths_of(pid: int) -> set[str]:
    return {path for path, _ in _shm_held(pid) if not path.endswith("(deleted)")}


def shm_files(pgid: int) -> set[str]:
    """/dev/shm files that members of group `pgid` hold open or mapped right now."""
    found = set()
    for pid in members(pgid):
        found |= _shm_paths_of(pid)
    return found


def _is_resource_tracker(pid: int) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    # A member that moved to its own process group is still in the session.
    _signal(members(pgid), sig)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pgid: int, deadline: float, spare_trackers: bool = False) -> list[int]:
    while True:
        _reap(pgid)
        left = members(pgid)
        if spare_trackers:  # also catches children forked while their parents were being killed
            _signal([pid for pid in left if not _is_resource_tracker(pid)], signal.SIGKILL)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop(pgid: int, term_timeout_s: float = 30.0, kill_timeout_s: float = 10.0) -> StopResult:
    """SIGTERM the whole group, SIGKILL it on the deadline, verify it is gone, clean its /dev/shm files."""
    if pgid <= 1 or pgid in (os.getpgrp(), os.getsid(0)):
        raise EngineError(f"refusing to stop process group {pgid}: it is not an engine's", permanent=True)
    started = time.monotonic()
    sent: list[str] = []
    shm = shm_files(pgid)  # record before killing: dead processes no longer say what they held
    survivors = members(pgid)
    if survivors:
        _signal_group(pgid, signal.SIGTERM)
        sent.append("SIGTERM")
        survivors = _wait_gone(pgid, time.monotonic() + term_timeout_s)
    if survivors:
        sent.append("SIGKILL")
        survivors = kill(pgid, kill_timeout_s)
    removed = [] if survivors else remove_unused_shm(shm)
    return StopResult(sent, round(time.monotonic() - started, 3), survivors, removed)


def kill(pgid: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL group or session `pgid`, Python's resource trackers last; the members left on the deadline.

    A resource tracker (it ignores SIGTERM) unlinks the semaphores and shared memory its clients
    registered once they are all dead: killed with them, vLLM's and the load generator's sem.mp-* and
    psm_* files leak, some of which no live process maps, so nothing else can name them."""
    deadline = time.monotonic() + timeout_s
    survivors = _wait_gone(pgid, deadline - timeout_s / 2, spare_trackers=True)
    if survivors:
        _signal_group(pgid, signal.SIGKILL)
        # A process in uninterruptible sleep (a stuck GPU driver call) survives even SIGKILL.
        survivors = _wait_gone(pgid, deadline)
    return survivors


def shm_inodes_in_use() -> set[int]:
    """The /dev/shm files some live process holds open or maps, by inode: a file's name is not enough, since
    glibc's sem_open maps a semaphore under a temporary name it then unlinks (its creator's maps read
    `/dev/shm/sem.XXXXXX (deleted)` while the semaphore lives on as `sem.mp-…`)."""
    return {inode for pid in psutil.pids() for _, inode in _shm_held(pid)}


def unused_shm(paths: set[str]) -> list[str]:
    """Those of `paths` that exist and that no live process holds open or maps."""
    in_use = shm_inodes_in_use()
    unused = []
    for path in sorted(paths):
        try:
            if os.stat(path).st_ino not in in_use:
                unused.append(path)
        except OSError:
            continue
    return unused


def remove_unused_shm(paths: set[str]) -> list[str]:
    """Delete those of `paths` that no live process holds open or mapped (what an engine left)."""
    # Only plain files directly in /dev/shm: the list comes back from the database.
    paths = {p for p in paths if Path(p).parent == SHM_DIR and ".." not in Path(p).parts}
    if not paths:
        return []
    removed = []
    for path in unused_shm(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # already gone: the engine or its resource tracker cleaned up
    return removed


# --- network ----------------------------------------------------------------------------------


def port_free(host: str, port: int) -> bool:
    """True if a server could bind (host, port) now."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, socktype, proto, _, addr in infos:
        with socket.socket(family, socktype, proto) as sock:
            # Same option uvicorn sets, so TIME_WAIT leftovers don't count as busy.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError:
                return False
    return True
