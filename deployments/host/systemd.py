"""systemd units for deployments: render one, install and enable it, and control it by systemctl.

Plain Python, no Django. systemctl is run with an argv list, never a shell.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from controlpanel.privatefile import write_private
from deployments.host import engineenv
from deployments.host.engineuser import EngineUser
from deployments.host.errors import HostError

UNIT_DIR = Path("/etc/systemd/system")
_UNIT_NAME = re.compile(r"^[a-zA-Z0-9_.@-]+\.service$")


class SystemdError(HostError):
    """systemd is not usable here, or a systemctl call failed."""

    PERMANENT = True


def unit_name(deployment_name: str, rank: int = 0) -> str:
    """The unit of a deployment's engine; a worker rank of a multi-node deployment has its own on its node."""
    return f"vllm-{deployment_name}.rank{rank}.service" if rank else f"vllm-{deployment_name}.service"


def available() -> bool:
    """True where systemd runs as PID 1 and we may write units (root)."""
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None and os.geteuid() == 0


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


def env_file_path(name: str, unit_dir: Path = UNIT_DIR) -> Path:
    return unit_dir / f"{name}.env"


def secret_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The unit's argv without secret flags, and the variables for its EnvironmentFile (engineenv.secret_argv)."""
    try:
        return engineenv.secret_argv(argv)
    except engineenv.SecretFlagError as exc:
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
        "Restart=on-failure", "RestartSec=30", "LimitNOFILE=1048576",
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


def install(name: str, text: str, unit_dir: Path = UNIT_DIR, secret_env: dict[str, str] | None = None) -> int:
    """Write the unit (0600) and its secrets' EnvironmentFile (0600), enable and start it; return the main PID."""
    if not _UNIT_NAME.match(name):
        raise SystemdError(f"{name!r} is not a unit name")
    if not available():
        raise SystemdError("systemd is not available on this node (or the agent is not root)")
    if secret_env:
        write_private(env_file_path(name, unit_dir), env_file_text(secret_env))
    write_private(unit_dir / name, text)
    systemctl("daemon-reload")
    systemctl("enable", "--now", name)
    return main_pid(name)


def main_pid(name: str) -> int:
    return int(systemctl("show", "-p", "MainPID", "--value", name).strip() or 0)


def stop(name: str) -> None:
    systemctl("stop", name)


def start(name: str) -> int:
    systemctl("start", name)
    return main_pid(name)


def uninstall(name: str, unit_dir: Path = UNIT_DIR) -> None:
    disable(name)
    (unit_dir / name).unlink(missing_ok=True)
    env_file_path(name, unit_dir).unlink(missing_ok=True)
    systemctl("daemon-reload")


def disable(name: str) -> None:
    """Stop the unit and keep it from starting at boot (a stopped deployment stays stopped); a unit
    never installed here (an engine being moved under systemd) has nothing to stop."""
    try:
        systemctl("disable", "--now", name)
    except SystemdError as exc:
        if "does not exist" not in str(exc) and "not loaded" not in str(exc):
            raise
