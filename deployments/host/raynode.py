"""Ray for vLLM's Ray executor (multi-node): the `ray start` command line of a head or worker node, where the
engine's `ray` lives, and how many nodes the cluster shows alive. Launching and stopping a Ray node go through
host/processes.py like an engine (own session, whole group stopped). Plain Python, no Django.

Every cluster uses Ray's token authentication: without it whoever reaches the GCS can run code
as the engine's user on every node. The pinned Ray (2.60) reads the mode and the token from the
environment (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), never from argv: each Ray node, the vLLM driver and the
panel's own status calls get them there, and a client without the token is refused
("Authentication required"). Each node's Ray is given its node's cluster address (--node-ip-address); the
dashboard is not started. Ray 2.60 still binds the GCS, raylet, object manager and workers on every interface
for any address but 127.0.0.1: host/firewall.py admits only the deployment's nodes to them.
"""
from __future__ import annotations

import secrets
import socket
import subprocess
from pathlib import Path

from deployments.host import processenv
from deployments.host.errors import HostError


class RayError(HostError):
    """Ray is missing, or the cluster cannot be asked."""


def ray_bin(vllm_bin: str) -> str:
    """The `ray` beside the engine's `vllm` (same venv), or the one on PATH."""
    return str(Path(vllm_bin).with_name("ray")) if "/" in str(vllm_bin) else "ray"


def check_installed(path: str) -> None:
    if "/" in path and not Path(path).is_file():
        raise RayError(f"Ray is not installed in the engine's environment ({path} is missing): install it there "
                       "(scripts/install-engine does) or deploy with the mp executor.", permanent=True)


def new_token() -> str:
    """A fresh cluster token (256 bits): one per Ray head start, so a restart never reuses it."""
    return secrets.token_hex(32)


def auth_env(token: str) -> dict[str, str]:
    """What every process of the cluster, and every client of it, needs in its environment."""
    if not token:
        raise RayError("the Ray cluster has no token: refusing to start or ask it without authentication",
                       permanent=True)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def free_port() -> int:
    """A port free now: each Ray node on a host needs its own agent port (two nodes on one host never clash)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def start_argv(ray: str, *, port: int, node_ip: str, num_gpus: int | None, head_address: str | None = None,
               temp_dir: str | None = None) -> list[str]:
    """`ray start --block` for the head (`head_address` None: it serves the GCS on `port`) or a worker
    joining `head_address:port`. `--block` keeps the command in the foreground: it is the group's leader,
    and it exits (taking the node's Ray processes with it) when any of them dies."""
    argv = [ray, "start", "--block", "--node-ip-address", node_ip, "--disable-usage-stats",
            "--dashboard-agent-listen-port", str(free_port())]
    if head_address is None:
        # No dashboard. The Ray Client server cannot be left out where grpc is installed (`ray start` refuses
        # port 0); it binds the node's address and localhost and asks for the token like the GCS.
        # No autoscaler monitor either (a fixed set of nodes): it serves unauthenticated metrics on a fixed port
        # (44217) on every interface.
        argv += ["--head", "--port", str(port), "--include-dashboard", "false", "--no-monitor",
                 "--ray-client-server-port", str(free_port())]
    else:
        argv += ["--address", f"{head_address}:{port}"]
    if temp_dir:
        argv += ["--temp-dir", temp_dir]
    if num_gpus is not None:
        argv += ["--num-gpus", str(num_gpus)]
    return argv


# Asks the GCS directly: `ray status` answers the same in ~5 s of CPU a call, this in ~1.5 s (pinned Ray).
_COUNT_ALIVE = """import sys
from ray._raylet import GcsClient
nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5).values()
print(sum(1 for n in nodes if n.state == 0))  # GcsNodeState ALIVE
"""


def alive_nodes(ray: str, address: str, env: dict[str, str], timeout_s: float = 20.0) -> int:
    """How many nodes the cluster at `address` shows alive; 0 while it cannot answer yet."""
    python = str(Path(ray).with_name("python")) if "/" in ray else "python3"  # the venv Ray is in
    try:
        out = subprocess.run([python, "-c", _COUNT_ALIVE, address], capture_output=True, text=True, timeout=timeout_s,
                             env=processenv.engine_environ(env), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 0
    except OSError as exc:
        raise RayError(f"cannot run {python}: {exc}", permanent=True) from exc
    lines = out.stdout.split()
    return int(lines[-1]) if out.returncode == 0 and lines and lines[-1].isdigit() else 0
