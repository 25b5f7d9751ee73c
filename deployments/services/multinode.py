"""Multi-node deployments, control-plane side: check a placement across nodes before
anything starts, and write one rank row per worker node. deployments/node/ranks.py runs it.

A placement is the head (the deployment's node and GPUs, rank 0) plus worker nodes, each with its
GPUs. The parallel layout decides the launch: with DP 1, vLLM's `--nnodes` launch splits TP × PP over
all of them (world size / nodes processes on every node); with DP > 1, its data-parallel launch runs
whole replicas (TP × PP each) on every node, the head's API server balancing over all of them.
"""
from dataclasses import dataclass

from deployments import flagpolicy, modelconfig, modelfit, userflags
from deployments.models import Deployment, DeploymentRank, ModelCopy, ModelRepo, Node
from deployments.layout import EXECUTORS, data_parallel, dp_split, executor, port_name, world_size
from deployments.services import repos
from deployments import claims
from plumbing.errors import ServiceError

# vLLM's multi-node launch (mp executor) needs these on every node; its data-parallel launch the second set.
NEEDED_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless")
DP_NEEDED_FLAGS = ("--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
                   "--data-parallel-address", "--data-parallel-rpc-port", "--headless")
MASTER_PORT_FIRST = 29500
# Set by the panel on every rank (services/ranks.py); refused in a user's engine flags. A fixed
# --data-parallel-rank would switch vLLM to external load balancing, which no rank here runs.
MULTINODE_FLAGS = ("nnodes", "node-rank", "master-addr", "master-port", "headless", "data-parallel-size-local",
                   "data-parallel-start-rank", "data-parallel-address", "data-parallel-rpc-port", "data-parallel-rank")


def check_executor(engine_args: dict, nodes: int) -> None:
    """Over several nodes only mp or ray can run; a bad value is refused before anything starts."""
    picked = executor(engine_args)
    if nodes > 1 and picked not in EXECUTORS:
        raise ServiceError(f"--distributed-executor-backend {picked} cannot span nodes: a multi-node deployment runs "
                           "vLLM's mp executor (the default) or ray.", field="engine_args", code="executor")


@dataclass
class Worker:
    """One worker node of a placement and the GPUs it serves on."""

    node: Node
    gpu_indices: list


def check(*, model: ModelRepo, head: Node, head_gpus: list, workers: list[Worker], engine_args: dict,
          master_port: int | None) -> None:
    """Refuse a placement that cannot work, naming the nodes: offline agents, different engine versions,
    an engine without the multi-node flags, GPUs that are not there or busy, a layout the nodes cannot
    split, a model that does not fit, or a worker node without the model that cannot download it there.
    Callers hold every node's row lock."""

    names = [w.node.name for w in workers]
    if head.name in names or len(set(names)) != len(names):
        raise ServiceError("Each node appears once in a placement (the head is rank 0).", field="workers")
    if reserved := sorted(set(engine_args) & set(MULTINODE_FLAGS)):
        raise ServiceError(f"--{reserved[0]} is set by the panel on every node of a multi-node deployment.",
                           field="engine_args")
    nodes = [head, *(w.node for w in workers)]
    offline = [n.name for n in nodes if not n.online]
    if offline:
        raise ServiceError(f"Node(s) {', '.join(offline)} are offline: every node of a placement needs its agent running.",
                           field="workers", code="node_offline")
    versions = {n.name: n.engine_version for n in nodes}
    if len(set(versions.values())) != 1 or not head.engine_version:
        raise ServiceError("Every node of a multi-node deployment needs the same vLLM: " + ", ".join(
            f"{name} runs {v or 'an unknown version'}" for name, v in versions.items()) + ".", field="workers",
            code="engine_versions")
    check_executor(engine_args, len(nodes))
    if executor(engine_args) == "ray":
        if data_parallel(engine_args):
            raise ServiceError("The Ray executor runs TP × PP over the nodes; with DP > 1 use vLLM's data-parallel "
                               "launch (the mp executor).", field="engine_args", code="executor")
        needed = ("--distributed-executor-backend",)
    else:
        needed = DP_NEEDED_FLAGS if data_parallel(engine_args) else NEEDED_FLAGS
    for n in nodes:
        missing = [f for f in needed if n.engine_flags and f not in n.engine_flags]
        if missing:
            raise ServiceError(f"The engine on {n.name} has no {missing[0]}: it cannot join a multi-node launch.",
                               field="workers")
        if n.engine_flags and (errors := userflags.check_flags(engine_args, set(n.engine_flags), n.engine_modules)):
            raise ServiceError(f"On {n.name}: {errors['extra_flags']}", field="engine_args")
    chosen = [(head, head_gpus), *((w.node, w.gpu_indices) for w in workers)]
    world, count = world_size(engine_args), len(nodes)
    if world % count and not data_parallel(engine_args):
        raise ServiceError(f"TP × PP × DP = {world} cannot be split evenly over {count} nodes "
                           f"({', '.join(n.name for n in nodes)}).", field="tp")
    per_node = world // count
    for node, indices in chosen:
        gpus = {g.index for g in node.gpus.all()}
        if set(indices) - gpus:
            raise ServiceError(f"{node.name} has no GPU {sorted(set(indices) - gpus)[0]}.", field="workers")
        if gpus and not data_parallel(engine_args) and len(indices) != per_node:
            raise ServiceError(f"TP × PP × DP = {world} over {count} nodes runs {per_node} rank(s) per node; "
                               f"{len(indices)} GPU(s) chosen on {node.name}.", field="workers")
        busy = [d for d in claims.deployment_holders(node, indices) if d.status in Deployment.IN_FLIGHT]
        if busy:
            raise ServiceError(f"{node.name} is busy: {busy[0].name} is {busy[0].get_status_display().lower()}.",
                               field="workers", code="gpus_busy")
    if data_parallel(engine_args):
        dp_split(engine_args, [(node.name, indices) for node, indices in chosen])
    for w in workers:
        _check_copy(model, w.node)
    _check_fit(model, nodes, [head_gpus, *(w.gpu_indices for w in workers)], engine_args)
    if master_port is not None and master_port < 1024:
        raise ServiceError(f"The {port_name(engine_args)} must be 1024 or above.", field="master_port")


def _check_copy(model: ModelRepo, node: Node) -> None:
    """A worker node loads its own copy: there already, or downloaded there by its rank's prepare step
    when the model comes from a hub and the node's disk has room for what is still missing."""
    copy = ModelCopy.objects.filter(model=model, node=node).first()
    if copy and copy.state == ModelCopy.State.READY:
        return
    if copy and copy.state == ModelCopy.State.DELETING:
        raise ServiceError(f"{model} is being deleted on {node.name}; download it there again after that.",
                           field="workers", code="in_use")
    if model.local_path or not model.files:
        raise ServiceError(f"{model} is not on {node.name} and cannot be downloaded there "
                           f"({'a local folder' if model.local_path else 'not inspected yet'}): copy it there first "
                           "(every node loads its own copy).", field="workers", code="not_on_node")
    room = repos.model_disk_check(model, [node])[0]
    if not room["fits"]:
        raise ServiceError(f"Not enough disk space on {node.name} to download {model} there: needs "
                           f"{modelfit.human_bytes(room['needed'])}, has {modelfit.human_bytes(room['free'])} free.",
                           field="workers", code="disk_full")


def _check_fit(model: ModelRepo, nodes: list[Node], indices: list[list], engine_args: dict) -> None:
    """Per-GPU weights plus KV room over every node's chosen GPUs, as the one-node fit check does."""
    if not model.config or not any(indices):
        return  # CPU nodes, or a config not read yet: nothing to weigh
    memories = [m for node, chosen in zip(nodes, indices)  # less what each node's display servers hold
                for m in modelfit.usable_memory(node.gpus.all(), node.foreign_processes, chosen)]
    files = [(f["path"], f["size"]) for f in model.files]
    try:
        spec = modelconfig.parse_config(model.config, files)
    except (ValueError, TypeError, KeyError):
        return
    tp, pp = int(engine_args.get("tensor-parallel-size", 1)), int(engine_args.get("pipeline-parallel-size", 1))
    result = modelfit.fit_check(spec, modelconfig.weight_bytes(files) or model.total_size, memories, tp, pp,
                                gpu_memory_utilization=flagpolicy.gpu_memory_utilization(engine_args))
    if not result.fits:
        raise ServiceError(f"Over {', '.join(n.name for n in nodes)}: {result.message}", field="tp", code="does_not_fit")


def free_master_port(head: Node) -> int:
    """The first master port no active multi-node deployment on the head uses."""
    taken = set(Deployment.objects.filter(node=head, status__in=Deployment.ACTIVE).exclude(master_port=None)
                .values_list("master_port", flat=True))
    taken |= set(head.deployments.filter(status__in=Deployment.ACTIVE).values_list("port", flat=True))
    port = MASTER_PORT_FIRST
    while port in taken:
        port += 1
    return port


def place(d: Deployment, workers: list[Worker], master_port: int | None) -> None:
    """Write the worker ranks (1, 2, …) and the master port of a checked placement (with Ray: the port of
    the Ray head; a one-node Ray deployment has no ranks)."""
    d.ranks.all().delete()
    for rank, w in enumerate(workers, start=1):
        DeploymentRank.objects.create(deployment=d, node=w.node, rank=rank, gpu_indices=sorted(w.gpu_indices))
    d.master_port = master_port or free_master_port(d.node)
    Deployment.objects.filter(pk=d.pk).update(master_port=d.master_port)


def lock_nodes(head: Node, workers: list[Worker]) -> list[Worker]:
    """Lock every node of the placement in id order (two placements over the same nodes never deadlock;
    each claim is all or nothing) and return the workers with fresh rows."""
    fresh = claims.lock_nodes([head.pk, *(w.node.pk for w in workers)])
    return [Worker(fresh[w.node.pk], sorted(set(w.gpu_indices))) for w in workers]
