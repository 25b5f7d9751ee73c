"""Who brings a process back when it dies: a systemd unit or a container (Docker, containerd, Podman), read from the
process's control group as systemd's own sd_pid_get_unit does. A GPU holder under a supervisor that restarts it comes
back a second after a SIGTERM by PID, so with consent it is stopped through its manager (`systemctl stop UNIT`, the
Docker API's stop) and named with its unit or container wherever it is shown. Plain Python, no Django."""
from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import asdict, dataclass

from deployments.host import processes, systemd
from deployments.host.errors import HostError

# A container's cgroup: Docker's systemd driver (docker-<id>.scope) and cgroupfs driver (/docker/<id>), containerd's
# CRI (cri-containerd-<id>.scope), Podman (libpod-<id>.scope).
_CONTAINER = re.compile(r"(?:^|/)(?:docker-|docker/|cri-containerd-|libpod-)([0-9a-f]{64})(?:\.scope)?(?:/|$)")
# A system service's cgroup: /system.slice/NAME.service (nested slices too); a unit of a user's own manager sits under
# user@UID.service and is not the system's to stop, a login session's scope is a shell, not a supervisor.
_SERVICE = re.compile(r"/system\.slice/(?:[^/]+\.slice/)*([^/]+\.service)(?:/|$)")
GONE_WITHIN_S = 30.0  # after its manager's stop, how long the holder may take to exit (TimeoutStopSec is 90 s)


class SupervisorError(HostError):
    """A supervisor could not be asked to stop, or its process outlived the stop."""


@dataclass(frozen=True)
class Supervisor:
    kind: str  # "systemd" or "container"
    name: str  # the unit, or the container's 64-hex id
    restart: str = ""  # its restart policy where it could be read ("always", "on-failure", "no")

    def __str__(self) -> str:
        what = f"systemd unit {self.name}" if self.kind == "systemd" else f"container {self.name[:12]}"
        return f"{what}{f', restart {self.restart}' if self.restart else ''}"


def cgroup_path(pid: int) -> str:
    """The process's cgroup: the v2 line's path, else the v1 name=systemd hierarchy's; "" when unreadable."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return ""
    paths = {hierarchy: path for _, hierarchy, path in (line for line in lines if len(line) == 3)}
    return paths.get("") if paths.get("", "/") != "/" else paths.get("name=systemd", "")


def parse(path: str) -> Supervisor | None:
    """The supervisor a cgroup path names, or None (a login session, a user's manager, the root)."""
    if m := _CONTAINER.search(path):
        return Supervisor("container", m[1])
    if m := _SERVICE.search(path):
        return Supervisor("systemd", m[1])
    return None


def of(pid: int) -> Supervisor | None:
    """The supervisor of `pid` with its restart policy, or None; never the one the agent itself runs under (stopping
    it would stop the panel: such a holder is signalled by PID instead)."""
    found = parse(cgroup_path(pid))
    if found is None or found == parse(cgroup_path(os.getpid())):
        return None
    return Supervisor(found.kind, found.name, _restart(found))


@functools.lru_cache(maxsize=256)  # read each time the agent looks at the GPUs (every few seconds): asked once
def _restart(sup: Supervisor) -> str:
    try:
        if sup.kind == "systemd":
            return systemd.systemctl("show", "-p", "Restart", "--value", systemd.other_unit(sup.name), timeout=10).strip()
        from deployments.host import containers

        return containers.client().containers.get(sup.name).attrs["HostConfig"]["RestartPolicy"]["Name"] or "no"
    except Exception:  # noqa: BLE001 - only shown; an unreadable policy leaves it out
        return ""


def stop(sup: Supervisor, pids: list[int]) -> str:
    """Stop `sup` through its manager and wait for `pids` (its holders) to be gone; what was done, for the timeline."""
    try:
        if sup.kind == "systemd":
            unit = systemd.other_unit(sup.name)
            systemd.systemctl("stop", unit)
            how = f"systemctl stop {unit}"
            enabled = systemd.systemctl("show", "-p", "UnitFileState", "--value", unit).strip() == "enabled"
            after = " (still enabled: it starts again at boot unless disabled)" if enabled else ""
        else:
            from deployments.host import containers

            containers.client().containers.get(sup.name).stop(timeout=int(GONE_WITHIN_S))
            how, after = f"docker stop {sup.name[:12]}", " (its restart policy keeps it stopped until started)"
    except HostError:
        raise
    except Exception as exc:  # noqa: BLE001 - the Docker SDK's errors, named for the user
        raise SupervisorError(f"cannot stop {sup}: {exc}") from exc
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := [p for p in pids if processes.alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        raise SupervisorError(f"{how} returned but PID {', '.join(map(str, left))} still runs")
    return f"{how}{after}"


def as_dict(sup: Supervisor | None) -> dict | None:
    return asdict(sup) if sup else None


def holder_text(p: dict, width: int = 80) -> str:
    """A GPU holder as pages, refusals and the timeline name it: PID, user, command, memory, its supervisor."""
    memory = f", {p['memory'] >> 20} MiB" if p.get("memory") else ""
    sup = p.get("supervisor")
    under = f"; {Supervisor(**sup)}" if sup else ""
    return f"PID {p['pid']} ({p['user']}: {p['command'][:width]}{memory}{under})"
