"""GPU claims: which active deployments hold a node's GPUs (as a head or a worker rank), and the node lock
every claiming path takes. Beneath both sides: the control plane checks a deploy with them
(services/deploys.py, multinode.py), the node checks again right before an engine starts (node/)."""
from django.db import transaction

from deployments.models import Deployment, DeploymentRank, ModelCopy, Node

__all__ = ["deployment_holders", "sleep_sharers", "awake_holders", "lock_node", "lock_nodes", "lock_copy_node",
           "first_clash", "model_users"]


def deployment_holders(node: Node, gpu_indices: list[int], exclude: Deployment | None = None):
    """Active deployments that hold any of these GPUs of the node, as its head or as a worker rank;
    on a node without GPUs, the whole host is the claim: every active deployment there."""
    holders = node.deployments.filter(status__in=Deployment.ACTIVE)
    has_gpus = bool(gpu_indices) or node.gpus.exists()
    if has_gpus:
        holders = holders.filter(gpus__index__in=gpu_indices).distinct()
    ranks = DeploymentRank.objects.filter(node=node, deployment__status__in=Deployment.ACTIVE).exclude(
        state__in=DeploymentRank.ENDED).values_list("deployment_id", "gpu_indices")
    as_rank = [pk for pk, held in ranks if not has_gpus or set(held or []) & set(gpu_indices)]
    if as_rank:
        holders = Deployment.objects.filter(pk__in=[*holders.values_list("pk", flat=True), *as_rank])
    return holders.exclude(pk=exclude.pk) if exclude else holders


def sleep_sharers(node: Node, gpu_indices: list[int], exclude: Deployment | None = None):
    """Loaded (ready or asleep) single-node sleep-mode deployments holding these GPUs: a sleep-mode deployment
    shares them with these, one awake at a time (deployments/node/sleep.py), rather than replacing them."""
    return deployment_holders(node, gpu_indices, exclude=exclude).filter(sleep_mode=True, status__in=Deployment.UP,
                                                                         master_port=None)


def awake_holders(node: Node, gpu_indices: list[int], exclude: Deployment | None = None) -> list[Deployment]:
    """Active deployments holding these GPUs that are not asleep: what a wake on them must wait for."""
    return [o for o in deployment_holders(node, gpu_indices, exclude=exclude) if o.status != Deployment.Status.SLEEPING]


def lock_node(node_id: int) -> Node:
    """Lock the node's row until the transaction ends: two claims on one node's GPUs are decided one after
    the other. The caller is inside transaction.atomic()."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("lock_node() outside a transaction locks nothing")
    return Node.objects.select_for_update().get(pk=node_id)


def lock_nodes(node_ids) -> dict[int, Node]:
    """Lock several nodes' rows in id order (two claims over the same nodes never deadlock): {id: fresh row}."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("lock_nodes() outside a transaction locks nothing")
    return {n.pk: n for n in Node.objects.select_for_update().filter(pk__in=list(node_ids)).order_by("pk")}


def lock_copy_node(copy_id: int) -> Node | None:
    """Lock the node of a model copy (None when the copy is gone): a copy's delete and a deploy of its model
    there are decided one after the other."""
    node_id = ModelCopy.objects.filter(pk=copy_id).values_list("node_id", flat=True).first()
    return lock_node(node_id) if node_id is not None else None


def first_clash(node: Node, gpu_indices: list[int], exclude: Deployment, spare=()) -> Deployment | None:
    """Under the node lock: another active deployment holding these GPUs (the whole host without GPUs), or None;
    `spare`: deployments that share them (asleep)."""
    with transaction.atomic():
        lock_node(node.pk)
        return deployment_holders(node, gpu_indices, exclude=exclude).exclude(pk__in=list(spare)).first()


def model_users(node_id: int, model_ids):
    """Active deployments that use one of these models on the node, as its head or through a worker rank there:
    a copy they load or serve from must not be deleted."""
    ranked = DeploymentRank.objects.filter(node_id=node_id).exclude(state__in=DeploymentRank.ENDED).values(
        "deployment_id")
    users = Deployment.objects.filter(status__in=Deployment.ACTIVE, model__in=model_ids)
    return users.filter(node_id=node_id) | users.filter(pk__in=ranked)
