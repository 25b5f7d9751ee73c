"""What every node of a multi-node deployment needs to know of the others: the head's address, a rank's
environment and launch flags, and whether a worker rank failed. The head's plan (plan.py, ranks.py), the
worker ranks (ranks.py) and the Ray cluster (raycluster.py) all read these; none of them imports another."""
from deployments import layout
from deployments.host import processenv
from deployments.models import Deployment, DeploymentRank
from deployments.node.steps import PlanFailed


def head_address(d: Deployment) -> str:
    """The address worker nodes reach the head at (its agent's --address)."""
    return d.node.address or "127.0.0.1"


def multinode_args(d: Deployment, rank: int, nnodes: int) -> dict:
    """The flags vLLM's multi-node launch needs on rank `rank` (workers run headless): `--nnodes`, or
    with DP > 1 its data-parallel form (this node's replicas and first DP rank)."""
    if layout.data_parallel(d.engine_args):
        local, start = layout.dp_ranks(d)[rank]
        args = {"data-parallel-size-local": local, "data-parallel-address": head_address(d),
                "data-parallel-rpc-port": d.master_port}
        if rank:  # the head takes DP ranks from 0 (without a start rank: internal load balancing)
            args.update({"headless": True, "data-parallel-start-rank": start})
        return args
    args = {"nnodes": nnodes, "node-rank": rank, "master-addr": head_address(d), "master-port": d.master_port}
    if rank:
        args["headless"] = True
    return args


def rank_env(d: Deployment, address: str, gpu_indices) -> dict:
    """The rank's engine environment: the deployment's, plus the address vLLM advertises for this node."""
    return {**processenv.deployment_env(d.env, gpu_indices), "VLLM_HOST_IP": address}


def ranks_failed(d: Deployment) -> None:
    """A failed worker rank fails the head's plan (while it prepares, loads or serves), naming it."""
    if not d.master_port:
        return
    bad = d.ranks.select_related("node").filter(state=DeploymentRank.State.FAILED).first()
    if bad:
        raise PlanFailed(f"Rank {bad.rank} on node {bad.node.name}: {bad.message or 'failed'}")
