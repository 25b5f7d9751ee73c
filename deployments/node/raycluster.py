"""Ray as the executor, node side. A deployment whose engine flags say
`--distributed-executor-backend ray` runs on a Ray cluster the panel starts for it:

  1. the head's agent starts the Ray head (`ray start --head --port <master port> --block`);
  2. each worker node's agent starts its Ray node (`ray start --address HEAD:PORT --block`) as its rank's
     process (node/ranks.py launches it where the mp layout launches a headless engine);
  3. the head waits until the cluster shows every node, then launches `vllm serve … --distributed-executor-backend ray`
     with RAY_ADDRESS set; vLLM places its workers over the cluster itself.

Every Ray process runs in the engine's environment with the deployment's marker, in a process group of
its own (host/processes.py), so Stop, a crash and reconcile end it like an engine: the head's Ray is found by
the marker (lifecycle.stop_marked), a worker's is its rank's group. Every Ray process carries the role "ray"
(ownership.ROLE_VAR): an agent that restarts while the cluster forms never adopts the Ray head as the engine.
Ray's own files go under the panel's var dir.

The cluster is authenticated: the head's agent makes a new token at each Ray head start
(`Deployment.ray_token`, write-only like other secrets), and every Ray node, `vllm serve` (Ray's driver)
and the panel's own status calls get it through their environment (host/raynode.auth_env).
"""
import time
from pathlib import Path

from django.conf import settings

from deployments import layout, sealed
from deployments.host import firewall, osuser, ownership, processes, processlog, raynode
from deployments.models import Deployment, DeploymentRank
from deployments.node import lifecycle
from deployments.node.cluster import head_address, rank_env, ranks_failed
from deployments.node.lifecycle import pgid_of
from deployments.node.steps import Aborted, PlanFailed, engine_user, stop_requested

S = Deployment.Status
JOIN_TIMEOUT_S = 120.0  # Ray nodes start in a few seconds; on 2 shared cores with an engine loading, slower
POLL_S = 1.0


def uses_ray(d: Deployment) -> bool:
    return bool(d.master_port) and layout.executor(d.engine_args) == "ray"


def _ray_bin() -> str:
    ray = raynode.ray_bin(settings.VLLM_BIN)
    try:
        raynode.check_installed(ray)
    except raynode.RayError as exc:
        raise PlanFailed(str(exc)) from exc
    return ray


def _temp_dir(d: Deployment) -> str:
    """This node's folder for the deployment's Ray files (each node its own, Ray >= 2.51). Ray puts Unix
    sockets under it (a path of at most 107 bytes): kept short."""
    user = engine_user("", "")  # Ray runs as the engine user: its files live in that user's home, not var/
    path = (Path(user.home) if user.separate else Path(settings.VAR_DIR)) / "ray" / str(d.pk)
    try:
        osuser.make_dirs_as(user, [path])  # by the engine user: its home is its own, links it planted included
    except osuser.EngineUserError as exc:
        raise PlanFailed(f"Cannot make Ray's folder on this node: {exc}") from exc
    return str(path)


# Ray's metrics export (an unauthenticated Prometheus endpoint the dashboard agent opens on every interface for
# any node address but 127.0.0.1, Ray 2.60) is not started: vLLM's own /metrics is what the panel reads.
NO_METRICS = {"RAY_enable_metrics_collection": "0"}


def token(d: Deployment) -> str:
    """The cluster's token as stored now: a worker node's agent loaded its row before the head made it."""
    stored = Deployment.objects.filter(pk=d.pk).values_list("ray_token", flat=True).first() or ""
    try:
        stored = sealed.unseal(stored)  # sealed at rest (a token stored before sealing existed: as it is)
    except sealed.Unreadable as exc:
        raise PlanFailed(f"Cannot read the Ray cluster's token on this node: {exc}") from exc
    d.ray_token = stored
    try:
        return raynode.auth_env(stored)["RAY_AUTH_TOKEN"]
    except raynode.RayError as exc:
        raise PlanFailed(str(exc)) from exc


def auth_env(d: Deployment) -> dict:
    """RAY_AUTH_MODE and RAY_AUTH_TOKEN: set last, so no deployment variable can switch them off."""
    return raynode.auth_env(token(d))


def node_env(d: Deployment, address: str, gpu_indices) -> dict:
    """A Ray node's environment: the rank's (the deployment's variables, its GPUs, VLLM_HOST_IP), the cluster's
    token (lifecycle adds the marker); vLLM's workers on that node inherit it from the raylet."""
    return {**rank_env(d, address, gpu_indices), "RAY_USAGE_STATS_ENABLED": "0", **NO_METRICS, **auth_env(d)}


def head_start(d: Deployment) -> str:
    """On the head: start the Ray head on the master port, marked as this deployment's."""
    ray = _ray_bin()
    try:
        firewall.check()  # a one-node Ray deployment has no pre-flight: refused here where its ports cannot be guarded
    except firewall.FirewallError as exc:
        raise PlanFailed(f"Head node {d.node.name}: {exc.message}") from exc
    if not processes.port_free("0.0.0.0", d.master_port):
        raise PlanFailed(f"Port {d.master_port} (the Ray head's) is in use on {d.node}.")
    d.marker = ownership.new_marker(d.pk)  # the engine launched later carries the same one
    d.ray_token = raynode.new_token()  # a new cluster, a new token: the workers' Ray nodes read it from the row
    d.log_path = str(Path(settings.VAR_DIR) / "logs" / f"{d.name}-{d.pk}-ray-{int(time.time())}.log")
    Deployment.objects.filter(pk=d.pk).update(marker=d.marker, ray_token=sealed.seal(d.ray_token), log_path=d.log_path)
    address = head_address(d)
    argv = raynode.start_argv(ray, port=d.master_port, node_ip=address, num_gpus=len(d.gpu_indices) or None,
                              temp_dir=_temp_dir(d))
    # Not the engine: its PID is not the row's (the engine's is); it is found and stopped by the marker.
    env = lifecycle.marked_env(node_env(d, address, d.gpu_indices), d.marker, lifecycle.RAY)
    handle = processes.launch(processes.EngineSpec(argv=argv, env=env,
                                             log_path=Path(d.log_path), run_as=engine_user("", "")))
    fw = firewall.guard(d.marker, [handle.pid], lifecycle.node_addresses(d))
    return f"Ray head: PID {handle.pid} at {address}:{d.master_port} (log {d.log_path}). {fw}"


def rank_argv(r: DeploymentRank) -> list[str]:
    """A worker node's Ray: joins the head's cluster with this node's GPUs."""
    d = r.deployment
    return raynode.start_argv(_ray_bin(), port=d.master_port, node_ip=r.node.address or "127.0.0.1",
                              num_gpus=len(r.gpu_indices) or None, head_address=head_address(d), temp_dir=_temp_dir(d))


def head_alive(d: Deployment) -> bool:
    """The Ray head still runs: a process carrying the deployment's marker outside the engine's group."""
    return any(not d.pgid or pgid_of(pid) != d.pgid for pid in ownership.find(d.marker))


def cluster_wait(d: Deployment) -> str:
    """Wait until the Ray cluster shows every node of the placement; a failed rank, a dead Ray head or a stop
    ends the wait."""
    want, address = d.ranks.count() + 1, f"{head_address(d)}:{d.master_port}"
    started = time.monotonic()
    env = {**rank_env(d, head_address(d), d.gpu_indices), **auth_env(d)}  # no marker: not part of the cluster
    while True:
        ranks_failed(d)
        if stop_requested(d):
            raise Aborted("stop requested")
        if not head_alive(d):
            last = processlog.tail(Path(d.log_path), 3) if d.log_path else []
            raise PlanFailed(f"The Ray head on {d.node} exited: {' | '.join(last) or 'no output'}")
        seen = raynode.alive_nodes(_ray_bin(), address, env)
        if seen >= want:
            return f"The Ray cluster at {address} shows {seen} node(s) after {time.monotonic() - started:.1f} s."
        if time.monotonic() - started > JOIN_TIMEOUT_S:
            raise PlanFailed(f"The Ray cluster at {address} shows {seen} of {want} nodes after {JOIN_TIMEOUT_S:.0f} s "
                             f"(nodes: {', '.join([d.node.name, *d.ranks.values_list('node__name', flat=True)])}).")
        time.sleep(POLL_S)


def engine_env(d: Deployment) -> dict:
    """What `vllm serve` needs besides the rank's environment: where the cluster is."""
    return {"RAY_ADDRESS": f"{head_address(d)}:{d.master_port}", "RAY_USAGE_STATS_ENABLED": "0", **auth_env(d)}
