"""Engines as Docker containers of their own (PANEL_ENGINE_RUNTIME=docker), through the Docker Engine API.

Why: in compose the node agent runs in a container, and an engine it spawns as a child lives in that
container's cgroup: restarting or upgrading the agent container stops every engine with it. An engine
started as a container of its own lives until it is stopped, whatever happens to the agent.

What the container is (container_config): the node image (PANEL_ENGINE_IMAGE, the agent's own), the host's
PID, network and IPC namespaces (engines listen on the host as on the process path, /dev/shm is the host's), the
mounts of PANEL_ENGINE_MOUNTS (the model store, the panel's var folder where the engine's log lies, the
engine user's home), the deployment's GPUs as a device request, and labels carrying the deployment's marker.
Its command is containerexec, which does what Popen does on the process path (log, session, engine user,
no_new_privs, working folder) and execs the engine: the container's main process is the engine. The agent
(pid: host) therefore follows, signals, stops and adopts it by PID and marker like any engine
(deployments/host/processes.py, ownership.py).

A container is kept after its engine exits (no AutoRemove: Docker refuses a restart policy on such a container, and
a persist sets one on the running engine's container, with no second load: KEEP_POLICY, which brings it back after a
crash and at the daemon's start, a boot). An exited container without that policy is removed at the next launch or
halt (sweep); the engine's log is the file, not Docker's.

Imports no host module but errors: processes.launch() calls start() (no cycle).
"""
from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

import docker
import docker.errors
import psutil
from docker.types import DeviceRequest

from deployments.host.errors import HostError

RUNTIME_VAR = "PANEL_ENGINE_RUNTIME"  # process (default): the agent's children; docker: containers of their own
IMAGE_VAR = "PANEL_ENGINE_IMAGE"
MOUNTS_VAR = "PANEL_ENGINE_MOUNTS"  # "source:target[:ro],...": what the engine must see at the agent's paths
ENGINE_LABEL = "vllm-panel.engine"  # on every engine container the panel starts
MARKER_LABEL = "vllm-panel.marker"  # the deployment's marker (ownership.MARKER_VAR in its environment too)
MARKER_VAR = "PANEL_ENGINE"
API_TIMEOUT_S = 30  # an image's first start on a busy daemon takes seconds; a hung daemon must not hang a plan
RUNTIMES = ("process", "docker")
EXEC_WAIT_S = 10.0  # containerexec's Python start and two execs: ~0.1-0.3 s here
DEFAULT_SOCKET = "unix:///var/run/docker.sock"
KEEP_POLICY = "unless-stopped"  # Docker starts it again when it exits and at its own start, unless stopped by the API


class ContainerError(HostError):
    """The Docker daemon refused or could not be reached; permanent when asking again cannot help."""


def runtime() -> str:
    value = os.environ.get(RUNTIME_VAR, "process").strip().lower() or "process"
    if value not in RUNTIMES:
        raise ContainerError(f"{RUNTIME_VAR}={value!r}: expected one of {', '.join(RUNTIMES)}", permanent=True)
    return value


def enabled() -> bool:
    """True when engines start as containers of their own (PANEL_ENGINE_RUNTIME=docker)."""
    return runtime() == "docker"


def client() -> docker.DockerClient:
    """The Docker Engine API at DOCKER_HOST (default: the local daemon's socket)."""
    try:
        return docker.from_env(timeout=API_TIMEOUT_S)
    except docker.errors.DockerException as exc:
        where = os.environ.get("DOCKER_HOST") or DEFAULT_SOCKET
        raise ContainerError(f"cannot reach the Docker daemon ({where}): {exc}") from exc


def mounts(spec: str | None = None) -> list[str]:
    """PANEL_ENGINE_MOUNTS as Docker binds ("source:target" or "source:target:ro")."""
    spec = os.environ.get(MOUNTS_VAR, "") if spec is None else spec
    binds = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3) or not all(parts[:2]) or not parts[1].startswith("/") or (
                len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ContainerError(f"{MOUNTS_VAR}: {item!r} is not source:/target[:ro|rw]", permanent=True)
        binds.append(item)
    return binds


def _gpus(env: dict[str, str]) -> tuple[list[DeviceRequest], dict[str, str]]:
    """The engine's GPUs (CUDA_VISIBLE_DEVICES, NVML's numbering) as one device request; inside the container
    those GPUs alone exist, numbered from 0, so CUDA_VISIBLE_DEVICES is renumbered to match."""
    visible = [g.strip() for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if not visible:
        return [], env
    request = DeviceRequest(driver="nvidia", device_ids=visible, capabilities=[["gpu"]])
    return [request], {**env, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(len(visible)))}


def container_config(args: dict, log_path: str | Path, image: str | None = None, keep: bool = False) -> dict:
    """containers.run()'s arguments for an engine whose subprocess.Popen arguments are `args`
    (processes.popen_args: args, env, cwd, user, group, extra_groups); `keep`: a persisted deployment's engine,
    which Docker starts again after a crash or a boot (KEEP_POLICY)."""
    image = image or os.environ.get(IMAGE_VAR, "")
    if not image:
        raise ContainerError(f"{RUNTIME_VAR}=docker needs {IMAGE_VAR}: the node image engines run in", permanent=True)
    command = [sys.executable, "-m", "deployments.host.containerexec", "--log", str(log_path)]
    if args.get("cwd"):
        command += ["--cwd", str(args["cwd"])]
    if args.get("user") is not None:
        command += ["--uid", str(args["user"]), "--gid", str(args.get("group", args["user"])),
                    "--groups", ",".join(str(g) for g in args.get("extra_groups") or ())]
    command += ["--", *args["args"]]
    device_requests, env = _gpus(dict(args["env"]))
    marker = env.get(MARKER_VAR, "")
    labels = {ENGINE_LABEL: "1", **({MARKER_LABEL: marker} if marker else {})}
    return {
        "image": image, "command": command, "environment": env, "labels": labels,
        # One marker may start two containers (a Ray head, then the engine on it): a suffix keeps names apart.
        "name": f"vllm-panel-{marker}-{secrets.token_hex(3)}" if marker else None,
        # The host's PIDs, as on the process path: the engine is an ordinary process there (not a namespace's
        # PID 1, with its signal and reaping quirks), and Docker kills what is left of it once its main process ends.
        "pid_mode": "host", "network_mode": "host", "ipc_mode": "host", "volumes": mounts(),
        "device_requests": device_requests,
        "restart_policy": {"Name": KEEP_POLICY if keep else "no"},
        "security_opt": ["no-new-privileges"], "detach": True,
    }


def start(args: dict, log_path: str | Path, keep: bool = False) -> int:
    """Start the engine as a container of its own; its main process's PID (the engine's, as the agent sees it)."""
    Path(log_path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    config = container_config(args, log_path, keep=keep)
    sweep()
    try:
        container = client().containers.run(**config)
        container.reload()
    except docker.errors.ImageNotFound as exc:
        raise ContainerError(f"the engine image {config['image']} is not on this host: {exc.explanation}",
                             permanent=True) from exc
    except docker.errors.APIError as exc:
        raise ContainerError(f"the Docker daemon refused the engine's container: {exc.explanation or exc}",
                             permanent=exc.is_client_error()) from exc
    except (docker.errors.DockerException, OSError) as exc:  # the daemon went away mid-call
        raise ContainerError(f"cannot reach the Docker daemon: {exc}") from exc
    state = container.attrs.get("State", {})
    if not state.get("Running") or not state.get("Pid"):
        raise ContainerError(f"the engine's container exited at once (code {state.get('ExitCode')}); "
                             f"its log is {log_path}", permanent=True)
    pid = int(state["Pid"])
    _wait_exec(pid)
    return pid


def _wait_exec(pid: int, timeout_s: float = EXEC_WAIT_S) -> None:
    """Return once the container's main process has exec'd the engine itself (containerexec, then setpriv, then
    /usr/bin/env where a shebang says so, each exec in place): while an exec is under way /proc/<pid>/environ
    cannot be read, and the marker that proves the engine ours goes missing for that moment (seen here: in 5
    launches of 15 the agent's ownership check failed once or more in the first 0.6 s without this wait)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            argv = psutil.Process(pid).cmdline()
        except psutil.Error:
            return  # gone already: the follow reads why from the log
        if argv and "deployments.host.containerexec" not in argv and Path(argv[0]).name not in ("setpriv", "env"):
            return
        time.sleep(0.02)


def find(marker: str | None = None) -> list[dict]:
    """The panel's engine containers (those carrying `marker`, when given): id, name, status, main PID."""
    label = f"{MARKER_LABEL}={marker}" if marker else ENGINE_LABEL
    try:
        # ignore_removed: a container removed between the list and its inspect (another stop) is not an error
        found = client().containers.list(all=True, filters={"label": label}, ignore_removed=True)
    except (docker.errors.DockerException, OSError) as exc:
        raise ContainerError(f"cannot list the engine containers: {exc}") from exc
    return [{"id": c.id, "name": c.name, "status": c.status, "pid": c.attrs.get("State", {}).get("Pid") or None,
             "marker": c.labels.get(MARKER_LABEL, "")} for c in found]


def _get(name: str):
    """The container called `name`, or None when it is gone."""
    try:
        return client().containers.get(name)
    except docker.errors.NotFound:
        return None
    except (docker.errors.DockerException, OSError) as exc:
        raise ContainerError(f"cannot read the container {name}: {exc}") from exc


def keep(marker: str) -> str:
    """A persist: the running engine container carrying `marker` gets KEEP_POLICY (the engine keeps serving: no
    second load); its name."""
    running = [c for c in find(marker) if c["status"] == "running"]
    if not running:
        raise ContainerError(f"no running engine container carries the marker {marker}", permanent=True)
    try:
        client().containers.get(running[0]["id"]).update(restart_policy={"Name": KEEP_POLICY})
    except docker.errors.APIError as exc:
        raise ContainerError(f"the Docker daemon refused the restart policy: {exc.explanation or exc}",
                             permanent=exc.is_client_error()) from exc
    except (docker.errors.DockerException, OSError) as exc:
        raise ContainerError(f"cannot reach the Docker daemon: {exc}") from exc
    return running[0]["name"]


def state(name: str) -> dict | None:
    """What Docker says of a kept engine's container: status (running, restarting, exited, ...), its main PID (0:
    none now), its restart policy and restart count; None when it is gone."""
    container = _get(name)
    if container is None:
        return None
    st, host = container.attrs.get("State", {}), container.attrs.get("HostConfig", {})
    return {"status": st.get("Status", ""), "pid": int(st.get("Pid") or 0), "exit_code": st.get("ExitCode"),
            "policy": (host.get("RestartPolicy") or {}).get("Name") or "no", "restarts": container.attrs.get("RestartCount", 0)}


def start_kept(name: str) -> None:
    """Start a kept container that is not running (its policy brings it back only after an exit or at the daemon's
    start: one stopped meanwhile stays down until started)."""
    container = _get(name)
    if container is None:
        raise ContainerError(f"the container {name} is gone", permanent=True)
    try:
        container.start()
    except (docker.errors.DockerException, OSError) as exc:
        raise ContainerError(f"cannot start the container {name}: {exc}") from exc


def release(name: str, timeout_s: float = 30) -> None:
    """A persisted engine stopped for good: no restart policy any more, stopped through Docker (so nothing brings
    it back), removed. A container already gone has nothing to release."""
    container = _get(name)
    if container is None:
        return
    try:
        container.update(restart_policy={"Name": "no"})
        container.stop(timeout=int(timeout_s))
        container.remove(force=True)
    except docker.errors.NotFound:
        return
    except (docker.errors.DockerException, OSError) as exc:
        raise ContainerError(f"cannot stop the container {name}: {exc}") from exc


def sweep(marker: str = "", wait_s: float = 0.0) -> list[str]:
    """Remove the panel's engine containers that have exited and that nothing brings back (no KEEP_POLICY): a
    stopped or crashed engine's. Given the `marker` of an engine just stopped, first wait (up to `wait_s`) for
    Docker to see its containers exit. Their names."""
    deadline = time.monotonic() + wait_s
    while marker and time.monotonic() < deadline and any(c["status"] == "running" for c in find(marker)):
        time.sleep(0.05)
    removed = []
    try:
        for c in client().containers.list(all=True, filters={"label": ENGINE_LABEL, "status": ["exited", "created", "dead"]},
                                          ignore_removed=True):
            if ((c.attrs.get("HostConfig") or {}).get("RestartPolicy") or {}).get("Name") not in ("always", KEEP_POLICY):
                c.remove(force=True)
                removed.append(c.name)
    except docker.errors.NotFound:
        pass  # removed meanwhile (another sweep)
    except (docker.errors.DockerException, OSError) as exc:
        raise ContainerError(f"cannot remove exited engine containers: {exc}") from exc
    return removed
