"""systemd units for deployments: render one, install and enable it, and control it by systemctl.

Plain Python, no Django. systemctl is run with an argv list, never a shell.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from deployments.host import processenv
from deployments.host.osuser import EngineUser
from deployments.host.errors import HostError
from plumbing.privatefile import write_private

# systemd's own SYSTEMD_UNIT_PATH names where units are read from; its first entry is where the panel writes them.
UNIT_DIR = Path((os.environ.get("SYSTEMD_UNIT_PATH") or "/etc/systemd/system").split(":")[0])
# How long systemd waits before it starts a failed engine again (Restart=on-failure): systemd owns the restarts
# of a persisted engine; the panel's auto-restart never restarts one.
RESTART_SEC = float(os.environ.get("ENGINE_UNIT_RESTART_SEC", "30"))
_UNIT_NAME = re.compile(r"^[a-zA-Z0-9_.@-]+\.service$")


class SystemdError(HostError):
    """systemd is not usable here, or a systemctl call failed."""

    PERMANENT = True


def unit_name(deployment_name: str, rank: int = 0) -> str:
    """The unit of a deployment's engine; a worker rank of a multi-node deployment has its own on its node."""
    return f"vllm-{deployment_name}.rank{rank}.service" if rank else f"vllm-{deployment_name}.service"


def available() -> bool:
    """True where systemd runs (as `systemctl is-system-running` says) and we may write units (root)."""
    if shutil.which("systemctl") is None or os.geteuid() != 0:
        return False
    try:
        out = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    # "offline": not booted with systemd (a container); the others are a running system manager.
    return out.stdout.strip() in {"running", "degraded", "starting", "initializing", "maintenance"}


def _escape(value: str) -> str:
    # systemd expands $NAME/${NAME} in ExecStart= and %-specifiers in most settings, quoted or not:
    # a literal "$" is "$$", a literal "%" is "%%". A newline would start a new setting: refuse it.
    value = str(value)
    if any(c in value for c in "\n\r\0"):
        raise SystemdError(f"a unit value cannot contain a line break: {value[:40]!r}")
    return value.replace("%", "%%")


def _quote(value: str, dollars: bool = True) -> str:
    """One double-quoted word in systemd's C-like syntax."""
    text = _escape(value).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + (text.replace("$", "$$") if dollars else text) + '"'


def env_file_text(env: dict[str, str]) -> str:
    """An EnvironmentFile: NAME="value" lines (systemd reads these quotes and escapes, expands nothing)."""
    return "".join(f"{name}={_quote(value, dollars=False).replace('%%', '%')}\n" for name, value in sorted(env.items()))


def checked(name: str) -> str:
    """`name` if it is one of the panel's unit names (vllm-<deployment>[.rank<n>].service), else SystemdError: root
    writes, unlinks and asks systemctl about it, so a name from the database (an admin's edit) is never a path."""
    if not _UNIT_NAME.match(name or "") or not name.startswith("vllm-"):
        raise SystemdError(f"{name!r} is not a unit name of the panel's")
    return name


def other_unit(name: str) -> str:
    """`name` if it is a service unit's name, else SystemdError: a unit the panel did not write (read from a GPU
    holder's control group), which it may only ask about and, with the operator's consent, stop."""
    if not _UNIT_NAME.match(name or "") or not name.endswith(".service") or name.startswith("-"):
        raise SystemdError(f"{name!r} is not a service unit's name")
    return name


def env_file_path(name: str, unit_dir: Path = UNIT_DIR) -> Path:
    return unit_dir / f"{name}.env"


def secret_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The unit's argv without secret flags, and the variables for its EnvironmentFile (processenv.secret_argv)."""
    try:
        return processenv.secret_argv(argv)
    except processenv.SecretFlagError as exc:
        raise SystemdError(str(exc)) from exc


def _user_lines(run_as: EngineUser | None) -> list[str]:
    """User=, Group=, SupplementaryGroups= of the engine user; no_new_privs for every engine."""
    lines = ["NoNewPrivileges=yes"]
    if run_as is not None and run_as.separate:
        lines += [f"User={_escape(run_as.name)}", f"Group={_escape(str(run_as.gid))}"]
        if run_as.groups:
            lines.append("SupplementaryGroups=" + " ".join(_escape(n) for n in (run_as.group_names or map(str, run_as.groups))))
    return lines


def render_unit(*, description: str, argv: list[str], env: dict[str, str], log_path: str,
                working_dir: str = "/", run_as: EngineUser | None = None, secret_env_file: str | None = None) -> str:
    """A unit that runs the engine as `run_as`, kills its whole control group on stop, and restarts it on failure.

    Secret variables are not in the text: they go in `secret_env_file` (0600, see install()); systemd reads
    it as root before it switches to the engine user. The log is opened by systemd too (as root).
    """
    exec_start = " ".join(_quote(a) for a in argv)
    env = {**(run_as.environ() if run_as is not None else {}), **env}
    lines = [
        "[Unit]", f"Description={_escape(description)}", "After=network-online.target", "Wants=network-online.target", "",
        "[Service]", "Type=simple", f"ExecStart={exec_start}", f"WorkingDirectory={_escape(working_dir)}",
        *(f"Environment={_quote(f'{name}={value}', dollars=False)}" for name, value in sorted(env.items())),
        *([f"EnvironmentFile={_escape(secret_env_file)}"] if secret_env_file else []),
        f"StandardOutput=append:{_escape(log_path)}", f"StandardError=append:{_escape(log_path)}",
        # The engine's children (EngineCore, workers) live in the same cgroup: stop them all.
        "KillMode=control-group", "KillSignal=SIGTERM", "TimeoutStopSec=60",
        "Restart=on-failure", f"RestartSec={RESTART_SEC:g}", "LimitNOFILE=1048576",
    ]
    lines += _user_lines(run_as)
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def systemctl(*args: str, timeout: float = 120.0) -> str:
    """Run `systemctl ARGS`; return its stdout or raise SystemdError with its stderr."""
    try:
        out = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemdError(f"systemctl {' '.join(args)} failed: {exc}", permanent=False) from exc
    if out.returncode != 0:
        raise SystemdError(f"systemctl {' '.join(args)} failed: {out.stderr.strip()[-500:]}", permanent=False)
    return out.stdout


def install(name: str, text: str, unit_dir: Path = UNIT_DIR, secret_env: dict[str, str] | None = None,
            start: bool = True) -> int:
    """Write the unit (0600) and its secrets' EnvironmentFile (0600), enable and (with `start`) start it; return the
    main PID (0 when not started: it starts at the next boot, or when started)."""
    checked(name)
    if not available():
        raise SystemdError("systemd is not available on this node (or the agent is not root)")
    if secret_env:
        write_private(env_file_path(name, unit_dir), env_file_text(secret_env))
    write_private(unit_dir / name, text)
    systemctl("daemon-reload")
    if not start:
        systemctl("enable", name)
        return 0
    systemctl("enable", "--now", name)
    return main_pid(name)


def main_pid(name: str) -> int:
    return int(systemctl("show", "-p", "MainPID", "--value", checked(name)).strip() or 0)


@dataclass
class UnitStatus:
    """What systemd says of a unit: its main process (0: none now), control group, whether it runs
    (active, activating while it waits to restart, inactive, failed), whether it starts at boot, restarts."""

    main_pid: int
    cgroup: str
    active: str
    enabled: str
    restarts: int

    @property
    def coming(self) -> bool:
        """It runs, or systemd will start it (again): restarting after a failure, or enabled for the boot."""
        return self.active in ("active", "activating", "reloading") or (
            self.active == "inactive" and self.enabled == "enabled")


def unit_status(name: str) -> UnitStatus:
    """The unit's MainPID, ControlGroup, ActiveState, UnitFileState and NRestarts (`systemctl show`)."""
    out = systemctl("show", "-p", "MainPID,ControlGroup,ActiveState,UnitFileState,NRestarts", checked(name))
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return UnitStatus(main_pid=int(props.get("MainPID") or 0), cgroup=props.get("ControlGroup", ""),
                      active=props.get("ActiveState", ""), enabled=props.get("UnitFileState", ""),
                      restarts=int(props.get("NRestarts") or 0))


def stop(name: str) -> None:
    systemctl("stop", checked(name))


def start(name: str) -> int:
    systemctl("start", checked(name))
    return main_pid(name)


def uninstall(name: str, unit_dir: Path = UNIT_DIR) -> None:
    disable(checked(name))
    (unit_dir / name).unlink(missing_ok=True)
    env_file_path(name, unit_dir).unlink(missing_ok=True)
    systemctl("daemon-reload")


def disable(name: str) -> None:
    """Stop the unit and keep it from starting at boot (a stopped deployment stays stopped); a unit
    never installed here (an engine being moved under systemd) has nothing to stop."""
    try:
        systemctl("disable", "--now", checked(name))
    except SystemdError as exc:
        if "does not exist" not in str(exc) and "not loaded" not in str(exc):
            raise
