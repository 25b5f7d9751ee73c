"""systemd units for deployments: render one, install and enable it, and control it by systemctl.

Plain Python, no Django. systemctl is run with an argv list, never a shell.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

UNIT_DIR = Path("/etc/systemd/system")
_UNIT_NAME = re.compile(r"^[a-zA-Z0-9_.@-]+\.service$")


class SystemdError(Exception):
    """systemd is not usable here, or a systemctl call failed."""

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message)
        self.message, self.permanent = message, permanent


def unit_name(deployment_name: str) -> str:
    return f"vllm-{deployment_name}.service"


def available() -> bool:
    """True where systemd runs as PID 1 and we may write units (root)."""
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None and os.geteuid() == 0


def _quote_env(value: str) -> str:
    # systemd's Environment= takes C-style quoting; escape what would end or split the value.
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def render_unit(*, description: str, argv: list[str], env: dict[str, str], log_path: str,
                working_dir: str = "/", user: str | None = None) -> str:
    """A unit that runs the engine, kills its whole control group on stop, and restarts it on failure."""
    exec_start = " ".join(shlex.quote(a).replace("%", "%%") for a in argv)
    lines = [
        "[Unit]", f"Description={description}", "After=network-online.target", "Wants=network-online.target", "",
        "[Service]", "Type=simple", f"ExecStart={exec_start}", f"WorkingDirectory={working_dir}",
        *(f"Environment={name}={_quote_env(value)}" for name, value in sorted(env.items())),
        f"StandardOutput=append:{log_path}", f"StandardError=append:{log_path}",
        # The engine's children (EngineCore, workers) live in the same cgroup: stop them all.
        "KillMode=control-group", "KillSignal=SIGTERM", "TimeoutStopSec=60",
        "Restart=on-failure", "RestartSec=30", "LimitNOFILE=1048576",
    ]
    if user:
        lines.append(f"User={user}")
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


def install(name: str, text: str, unit_dir: Path = UNIT_DIR) -> int:
    """Write the unit, enable and start it; return the engine's main PID."""
    if not _UNIT_NAME.match(name):
        raise SystemdError(f"{name!r} is not a unit name")
    if not available():
        raise SystemdError("systemd is not available on this node (or the agent is not root)")
    (unit_dir / name).write_text(text)
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
    systemctl("disable", "--now", name)
    (unit_dir / name).unlink(missing_ok=True)
    systemctl("daemon-reload")
