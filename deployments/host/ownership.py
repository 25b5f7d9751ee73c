"""Proof that a process group is an engine the panel started, before anything signals it.

Every engine gets a marker in its environment (`PANEL_ENGINE=<deployment id>.<random nonce>`),
set by the panel itself, inherited by EngineCore and the workers, readable by root from
`/proc/<pid>/environ` for as long as the process lives. A stored PID or PGID alone proves
nothing: after a reboot or PID reuse it names someone else's process. Units run by systemd carry
the same marker (Environment=) and are also recognised by their cgroup. Plain Python, no Django.
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from deployments import secrets as masking  # plain Python, no Django
from deployments.host import processes
from deployments.host.errors import HostError

MARKER_VAR = "PANEL_ENGINE"
# What a marked process is to its deployment: "engine" (vllm serve, adopted as the engine) or "ray" (a Ray node).
ROLE_VAR = "PANEL_ENGINE_ROLE"
# Never signalled, even when the operator asked to stop other processes on the GPUs: a display
# server going down takes the whole desktop (and its user's work) with it.
DISPLAY_SERVERS = frozenset({"Xorg", "X", "Xwayland", "gnome-shell", "kwin_wayland", "kwin_x11", "sway",
                             "weston", "mutter", "gdm-x-session", "sddm-greeter", "cinnamon", "plasmashell"})


def new_marker(deployment_id: int) -> str:
    """A fresh marker for one launch: the deployment id and a nonce nobody else can guess."""
    return f"{deployment_id}.{secrets.token_hex(12)}"


def environ_var(pid: int, name: str) -> str | None:
    """One variable of a process's environment as it started, or None (gone, unset, or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def marker_of(pid: int) -> str | None:
    """The marker in a process's environment, or None (gone, not ours, or not readable)."""
    return environ_var(pid, MARKER_VAR)


def engines_marked(marker: str | None) -> list[int]:
    """The engine leaders (process group leaders) carrying `marker`: processes the panel launched as the engine itself (ROLE_VAR
    "engine"), never a Ray node of the same deployment, which carries the marker too (ROLE_VAR "ray")."""
    leaders = []
    for pid in find(marker):
        try:
            leader = os.getpgid(pid) == pid  # its children (EngineCore, workers) inherit the marker and the role
        except OSError:
            continue
        if leader and environ_var(pid, ROLE_VAR) == "engine":
            leaders.append(pid)
    return leaders


def unit_of(pid: int) -> str | None:
    """The systemd service whose cgroup holds `pid` ("vllm-x.service"), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        for part in reversed(line.rsplit(":", 1)[-1].split("/")):
            if part.endswith(".service"):
                return part
    return None


def pid_owned(pid: int | None, marker: str | None, unit: str | None = None) -> bool:
    """True when `pid` runs and carries this marker (or runs in this systemd unit's cgroup)."""
    if not pid or not (marker or unit):
        return False
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return False
    except psutil.Error:
        return False
    return bool(marker and marker_of(pid) == marker) or bool(unit and unit_of(pid) == unit)


def owned(pgid: int | None, marker: str | None, unit: str | None = None) -> bool:
    """True when a live member of group (or session) `pgid` carries `marker` or runs in `unit`.

    The group id cannot be reused while one of our processes still has it, so one proven member
    proves the group. No marker and no unit (a row from before markers) proves nothing."""
    if not pgid or pgid <= 1 or not (marker or unit):
        return False
    return any(pid_owned(pid, marker, unit) for pid in processes.members(pgid))


def lineage(pid: int) -> list[psutil.Process]:
    """`pid` and its live ancestors below init, nearest first, each proven older than the process
    below it: a parent PID read just as the parent exited and its PID was reused names a younger
    process, and the walk stops there instead of taking a stranger for an ancestor."""
    chain: list[psutil.Process] = []
    try:
        proc = psutil.Process(pid)
        born = proc.create_time()
        while proc is not None and proc.pid > 1:
            chain.append(proc)
            proc = proc.parent()
            if proc is not None:
                parent_born = proc.create_time()
                if parent_born > born + 0.01:
                    break
                born = parent_born
    except psutil.Error:
        pass
    return chain


def owner(pid: int, markers: dict[str, tuple[int | None, float | None]],
          units: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The marker (of `markers`) that `pid` or one of its ancestors carries, or the unit (of `units`)
    whose cgroup holds one of them; None when neither does.

    vLLM's titled children (VLLM::EngineCore, VLLM::Worker) are why descent counts: setproctitle
    writes the title over the memory /proc/<pid>/environ reads, so they no longer show the marker
    they inherited, but their API server (or Ray's raylet) still does. `markers` maps each marker to
    the (PID, create time) recorded for it: the recorded PID, when it is the carrier, must have that
    create time (None: nothing recorded, the marker alone proves it)."""
    for proc in lineage(pid):
        marker = marker_of(proc.pid)
        if marker in markers:
            recorded_pid, born = markers[marker]
            try:
                if proc.pid != recorded_pid or not born or processes.same_start(proc.create_time(), born):
                    return marker
            except psutil.Error:
                pass
            return None
        if units and (unit := unit_of(proc.pid)) in units:
            return unit
    return None


def describe(pid: int) -> dict:
    """PID, user, command line and process name, for telling an operator what holds a GPU."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return {"pid": pid, "user": proc.username(), "name": proc.name(),
                    # Shown on pages and in 409s: a stranger's --api-key or token stays hidden.
                    "command": masking.scrub(" ".join(proc.cmdline()))[:300] or proc.name()}
    except psutil.Error:
        return {"pid": pid, "user": "?", "name": "?", "command": "?"}


def short_command(command: str, limit: int = 80) -> str:
    """A command line to quote in one message: its start and its end, the middle elided, so a port or a path at the
    end is never cut into another ("…http.server 1877" read as another port than 18771)."""
    if len(command) <= limit:
        return command
    head = (limit - 3) // 2
    return f"{command[:head]} … {command[-(limit - 3 - head):]}"


def is_display_server(info: dict, graphics: bool = False) -> bool:
    """A display server, never stopped nor waited for: NVML lists it as a graphics process only (`graphics`), or its
    name or command's program is one of DISPLAY_SERVERS."""
    return graphics or info.get("name") in DISPLAY_SERVERS or Path(
        str(info.get("command", "")).split(" ")[0]).name in DISPLAY_SERVERS


class RefusedToSignal(HostError):
    """A process asked to be stopped is the agent itself or one of its ancestors."""


@dataclass
class HoldersStopped:
    """What stop_holders() did: every process signalled (PID, user, command, the holder it descends
    from), the signals sent, and the PIDs still alive after the deadlines."""

    signalled: list[dict] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)


def _tree(holders: list[psutil.Process], spared: set[int]) -> dict[int, tuple[psutil.Process, int]]:
    """The live holders and their descendants (PID -> (process, the holder it descends from)), without
    display servers. psutil.Process objects remember their create time, so a PID reused later is
    never signalled through them."""
    found: dict[int, tuple[psutil.Process, int]] = {}
    for holder in holders:
        if not _running(holder):
            continue
        try:
            procs = [holder, *holder.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            if proc.pid not in spared and proc.pid not in found and not is_display_server(describe(proc.pid)):
                found[proc.pid] = (proc, holder.pid)
    return found


def stop_holders(pids: list[int], term_timeout_s: float = 30.0, kill_timeout_s: float = 10.0) -> HoldersStopped:
    """SIGTERM exactly `pids` and their own descendants, SIGKILL what is left on the deadline.

    Never their process group or session: a GPU holder started from a shell shares that shell's
    session, and a training job's siblings (its launcher, a data server) are not on the GPU. The
    agent and its ancestors are refused (an operator's holder list cannot take the panel down)."""
    agent = {p.pid for p in lineage(os.getpid())}
    if agent & set(pids):
        raise RefusedToSignal(f"PID {sorted(agent & set(pids))[0]} is the node agent or one of its parents",
                              permanent=True)
    result = HoldersStopped()
    holders = []
    for pid in pids:
        try:
            holders.append(psutil.Process(pid))
        except psutil.Error:
            continue  # gone already
    tree: dict[int, tuple[psutil.Process, int]] = {}
    for sig, timeout in ((signal.SIGTERM, term_timeout_s), (signal.SIGKILL, kill_timeout_s)):
        # Collected again before each signal: a holder that forked meanwhile has new descendants.
        for pid, entry in _tree(holders, agent).items():
            if pid not in tree:
                tree[pid] = entry
                result.signalled.append({**describe(pid), "holder": entry[1]})
        alive = [proc for proc, _ in tree.values() if _running(proc)]
        if not alive:
            break
        for proc in alive:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        result.signals.append(sig.name)
        if not _wait(alive, timeout):
            break
    result.survivors = sorted(p.pid for p, _ in tree.values() if _running(p))
    return result


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in procs if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def engine_processes() -> list[int]:
    """PIDs that look like a vLLM engine (API server, EngineCore, workers), whoever started them.

    On a host without GPUs the whole host is one engine's claim: these are what hold it."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            name = proc.info["name"] or ""
        except psutil.Error:
            continue
        if name.startswith("VLLM::") or "vllm serve" in cmd or "vllm.entrypoints.openai" in cmd:
            found.append(proc.info["pid"])
    return found


def agent_alive(pid: int | None) -> bool:
    """True when `pid` runs a node agent (a stored agent PID may have been reused since)."""
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "nodeagent" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def find(marker: str | None) -> list[int]:
    """Live PIDs carrying `marker`: an engine launched a moment before its agent died, whose PID
    never reached the database, is still found (and stopped or adopted) by its marker."""
    if not marker:
        return []
    found = []
    for pid in psutil.pids():
        if marker_of(pid) == marker:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    found.append(pid)
            except psutil.Error:
                continue
    return sorted(found)
