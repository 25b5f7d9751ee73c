"""A deployment's parallel layout, read from its engine flags: the executor, TP × PP × DP, how data-parallel
replicas split over nodes, what its master port is. Plain functions beneath both sides: the control plane checks
a placement with them (services/multinode.py), the node launches each rank with them (deployments/node/)."""
from deployments.models import Deployment
from plumbing.errors import ServiceError

# The executors a deployment may span nodes with: vLLM's own multi-node launch, or a Ray cluster the panel
# starts on the nodes (services/raycluster.py). Picked with the engine flag --distributed-executor-backend.
EXECUTORS = ("mp", "ray")


def executor(engine_args: dict) -> str:
    """The executor the user picked with --distributed-executor-backend ("mp" when unset)."""
    for name in ("distributed-executor-backend", "distributed_executor_backend"):
        if engine_args.get(name) not in (None, "", False):
            return str(engine_args[name])
    return "mp"


def layout(engine_args: dict) -> tuple[int, int, int]:
    """(TP, PP, DP) of the engine flags: TP × PP GPUs per replica, DP replicas."""
    return (int(engine_args.get("tensor-parallel-size", 1)), int(engine_args.get("pipeline-parallel-size", 1)),
            int(engine_args.get("data-parallel-size", 1)))


def world_size(engine_args: dict) -> int:
    tp, pp, dp = layout(engine_args)
    return tp * pp * dp


def data_parallel(engine_args: dict) -> bool:
    """Whether a multi-node deployment runs vLLM's data-parallel launch (DP > 1) rather than `--nnodes`."""
    return layout(engine_args)[2] > 1


def dp_split(engine_args: dict, chosen: list[tuple[str, list]]) -> list[int]:
    """Replicas per node (head first, given as (node name, chosen GPUs)) of a data-parallel layout: a GPU
    node runs its chosen GPUs / (TP × PP); nodes without GPUs (CPU engines) share the replicas evenly,
    each running TP × PP processes per replica. Refuses a split that does not add up, naming the nodes."""
    tp, pp, dp = layout(engine_args)
    per_replica, names = tp * pp, [name for name, _ in chosen]
    on_cpu = [name for name, gpus in chosen if not gpus]
    if on_cpu and len(on_cpu) != len(chosen):
        raise ServiceError(f"A data-parallel layout runs on GPUs on every node or on none: no GPU chosen on "
                           f"{', '.join(on_cpu)}.", field="workers")
    if on_cpu:
        if dp % len(chosen):
            raise ServiceError(f"DP = {dp} replicas cannot be split evenly over the {len(chosen)} CPU nodes "
                               f"{', '.join(names)}.", field="dp")
        return [dp // len(chosen)] * len(chosen)
    for name, gpus in chosen:
        if len(gpus) % per_replica:
            raise ServiceError(f"TP × PP = {per_replica} GPU(s) per replica, and a replica runs on one node: the "
                               f"{len(gpus)} GPU(s) chosen on {name} are not whole replicas.", field="workers")
    replicas = [len(gpus) // per_replica for _, gpus in chosen]
    if sum(replicas) != dp:
        raise ServiceError(f"DP = {dp} replicas of TP × PP = {per_replica}, but the GPUs chosen hold {sum(replicas)} ("
                           + ", ".join(f"{name}: {n}" for name, n in zip(names, replicas)) + ").", field="dp")
    return replicas


def dp_ranks(d: Deployment, head_gpus: list | None = None) -> list[tuple[int, int]]:
    """(replicas, first DP rank) per node of a placed data-parallel deployment, head first (on `head_gpus`
    when given: a redeploy checks its new GPUs)."""
    chosen = [(d.node.name, d.gpu_indices if head_gpus is None else head_gpus),
              *((r.node.name, r.gpu_indices) for r in d.ranks.select_related("node"))]
    replicas = dp_split(d.engine_args, chosen)
    return [(n, sum(replicas[:i])) for i, n in enumerate(replicas)]


def port_name(engine_args: dict) -> str:
    """What the deployment's master_port is to vLLM: the head's port every rank meets at."""
    if executor(engine_args) == "ray":
        return "Ray head port"
    return "DP RPC port" if data_parallel(engine_args) else "master port"
