"""Proof that a process group is an engine the panel started, before anything signals it.

Every engine gets a marker in its environment (`PANEL_ENGINE=<deployment id>.<random nonce>`),
set by the panel itself, inherited by EngineCore and the workers, readable by root from
`/proc/<pid>/environ` for as long as the process lives. A stored PID or PGID alone proves
nothing: after a reboot or PID reuse it names someone else's process. Units run by systemd carry
the same marker (Environment=) and are also recognised by their cgroup. Plain Python, no Django.
"""
from __future__ import annotations

import secrets
from pathlib import Path

import psutil

from deployments.host import engine

MARKER_VAR = "PANEL_ENGINE"
# Never signalled, even when the operator asked to stop other processes on the GPUs: a display
# server going down takes the whole desktop (and its user's work) with it.
DISPLAY_SERVERS = frozenset({"Xorg", "X", "Xwayland", "gnome-shell", "kwin_wayland", "kwin_x11", "sway",
                             "weston", "mutter", "gdm-x-session", "sddm-greeter", "cinnamon", "plasmashell"})


def new_marker(deployment_id: int) -> str:
    """A fresh marker for one launch: the deployment id and a nonce nobody else can guess."""
    return f"{deployment_id}.{secrets.token_hex(12)}"


def marker_of(pid: int) -> str | None:
    """The marker in a process's environment, or None (gone, not ours, or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = MARKER_VAR.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


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
    return any(pid_owned(pid, marker, unit) for pid in engine.members(pgid))


def describe(pid: int) -> dict:
    """PID, user, command line and process name, for telling an operator what holds a GPU."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return {"pid": pid, "user": proc.username(), "name": proc.name(),
                    "command": " ".join(proc.cmdline())[:300] or proc.name()}
    except psutil.Error:
        return {"pid": pid, "user": "?", "name": "?", "command": "?"}


def is_display_server(info: dict) -> bool:
    return info.get("name") in DISPLAY_SERVERS or Path(str(info.get("command", "")).split(" ")[0]).name in DISPLAY_SERVERS


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
