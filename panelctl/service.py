"""`./panel service install | remove | show [start options]`: the whole panel as one systemd unit, so that a reboot
brings back what `./panel start` runs (Redis unless REDIS_URL, the web, the workers, the node agent, the gateway)
beside the persisted engines systemd starts, which the agent then adopts by their markers.

The unit runs `./panel start` with the options given here, in this checkout, with `.env` read when there is one.
KillMode=process: a stop or restart of the panel signals the launcher alone, which stops its own children; the
engines it launched keep serving (as after Ctrl-C), and the agent adopts them when it is back."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from plumbing.privatefile import write_private

UNIT = "vllm-panel.service"


def unit_dir() -> Path:
    """Where units are written: systemd's SYSTEMD_UNIT_PATH's first entry, else /etc/systemd/system."""
    return Path((os.environ.get("SYSTEMD_UNIT_PATH") or "/etc/systemd/system").split(":")[0])


def _systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _checked(*args: str) -> None:
    out = _systemctl(*args)
    if out.returncode != 0:
        raise SystemExit(f"systemctl {' '.join(args)} failed: {out.stderr.strip()[-500:]}")


def unit_text(start_args: list[str], base_dir: Path) -> str:
    """The unit's text: ExecStart is `<checkout>/panel start` with `start_args`, each a word of its own."""
    words = [str(base_dir / "panel"), "start", *start_args]
    if any(c in w for w in words for c in "\n\r\0"):
        raise SystemExit("an option cannot contain a line break")
    exec_start = " ".join(shlex.quote(w).replace("%", "%%").replace("$", "$$") for w in words)
    return "\n".join([
        "[Unit]",
        "Description=vLLM control panel (./panel start: web, workers, node agent, gateway)",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"WorkingDirectory={base_dir}",
        f"EnvironmentFile=-{base_dir / '.env'}",
        f"ExecStart={exec_start}",
        "Restart=always",
        "RestartSec=5",
        "KillMode=process",
        "TimeoutStopSec=60",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def install(start_args: list[str], base_dir: Path) -> str:
    """Write the unit, enable it for the boot and start it now."""
    try:
        running = os.geteuid() == 0 and _systemctl("is-system-running").stdout.strip() in (
            "running", "degraded", "starting", "initializing", "maintenance")
    except (OSError, subprocess.TimeoutExpired):
        running = False
    if not running:
        raise SystemExit("systemd is not running here, or this is not root: `./panel service show` prints the unit to "
                         f"install by hand as {unit_dir() / UNIT}.")
    write_private(unit_dir() / UNIT, unit_text(start_args, base_dir))
    _checked("daemon-reload")
    _checked("enable", "--now", UNIT)
    return (f"Installed {unit_dir() / UNIT}: the panel starts at boot. `systemctl status {UNIT}` shows it; "
            "`./panel service remove` undoes it.")


def remove() -> str:
    """Stop and disable the unit and delete it; the engines keep serving."""
    if (unit_dir() / UNIT).exists():
        _checked("disable", "--now", UNIT)
        (unit_dir() / UNIT).unlink()
        _checked("daemon-reload")
    return f"Removed {UNIT}; engines the panel started keep serving."
