"""What brings a persisted engine back after a crash or a boot: its systemd unit (engines as processes of the host),
or, with PANEL_ENGINE_RUNTIME=docker (compose: the agent runs in a container and has no systemd), the engine's own
container kept with Docker's restart policy (containers.KEEP_POLICY). A deployment's `systemd_unit` names it: a unit
("vllm-<name>.service") or "container:<name>". Either is asked the same questions, answered in systemd's terms
(systemd.UnitStatus), so the agent follows both the same way (deployments/node/units.py)."""
from deployments.host import containers, systemd

PREFIX = "container:"
Error = (systemd.SystemdError, containers.ContainerError)  # what asking a keeper can raise


def available() -> bool:
    """Whether this node can keep an engine across crashes and boots: engines in containers, or systemd (as root)."""
    return containers.enabled() or systemd.available()


def is_container(name: str | None) -> bool:
    return bool(name) and name.startswith(PREFIX)


def of_container(container_name: str) -> str:
    return PREFIX + container_name


def status(name: str) -> systemd.UnitStatus:
    """The keeper's state as systemd says it: a kept container runs ("active"), waits to restart ("activating"), or
    has exited ("inactive", or "failed" with a non-zero code); "enabled" while its restart policy brings it back."""
    if not is_container(name):
        return systemd.unit_status(name)
    found = containers.state(name[len(PREFIX):])
    if found is None:
        return systemd.UnitStatus(main_pid=0, cgroup="", active="inactive", enabled="not-found", restarts=0)
    active = {"running": "active", "restarting": "activating"}.get(found["status"]) or (
        "failed" if found["exit_code"] else "inactive")
    enabled = "enabled" if found["policy"] in ("always", containers.KEEP_POLICY) else "disabled"
    return systemd.UnitStatus(main_pid=found["pid"], cgroup="", active=active, enabled=enabled,
                              restarts=int(found["restarts"] or 0))


def start(name: str) -> None:
    if is_container(name):
        containers.start_kept(name[len(PREFIX):])
    else:
        systemd.start(name)


def disable(name: str, term_s: float = 30) -> None:
    """Stop what it runs and keep it from coming back (a stopped deployment stays stopped)."""
    if is_container(name):
        containers.release(name[len(PREFIX):], term_s)
    else:
        systemd.disable(name)


def uninstall(name: str) -> None:
    if is_container(name):
        containers.release(name[len(PREFIX):])
    else:
        systemd.uninstall(name)


def restarts_how(name: str) -> str:
    """Who starts the engine again, for the timeline."""
    if is_container(name):
        return f"Docker's restart policy {containers.KEEP_POLICY}"
    return f"systemd's Restart=on-failure, RestartSec={systemd.RESTART_SEC:g} s"
