"""Celery tasks: thin wrappers that load by ID and call the service of the same name.

Host tasks are sent to the node's own queue (`node.<name>`) by the service that enqueues them;
the control-plane tasks go to the default `control` queue.
"""
import socket

from celery import shared_task

from deployments import loads, modelcopies
from deployments.host import hub
from deployments.node import persist, plan, ranks, redrive, sleep, watch  # noqa: F401 - redrive: its signals count the work in hand
from deployments.services import repos


@shared_task(name="deployments.node_ping")
def node_ping() -> dict:
    """Answer from whichever agent ran it: proves routing to a node's queue reaches that node."""
    from django.conf import settings

    return {"hostname": socket.gethostname(), "node": settings.NODE_NAME}


@shared_task(name="deployments.model_inspect", autoretry_for=(hub.HubError,), retry_backoff=5, max_retries=5)
def model_inspect(model_id: int) -> None:
    """Fetch a repo's files and config from the Hub (retried while the Hub is unreachable)."""
    repos.model_inspect(model_id)


@shared_task(name="deployments.model_inspect_local")
def model_inspect_local(model_id: int, node_id: int) -> None:
    """On a node: read a local model folder."""
    repos.model_inspect_local(model_id, node_id)


@shared_task(name="deployments.model_copy_download")
def model_copy_download(copy_id: int) -> None:
    """On a node: download (or resume) a model copy."""
    modelcopies.model_copy_download(copy_id)


@shared_task(name="deployments.model_copy_remove")
def model_copy_remove(copy_id: int) -> None:
    """On a node: delete a model copy's files."""
    repos.model_copy_remove(copy_id)


@shared_task(name="deployments.deployment_run")
def deployment_run(deployment_id: int) -> None:
    """On a node: run the deploy plan."""
    plan.deployment_run(deployment_id)


@shared_task(name="deployments.deployment_follow")
def deployment_follow(deployment_id: int) -> None:
    """On a node: follow an engine that was loading when the agent restarted."""
    plan.deployment_follow(deployment_id)


@shared_task(name="deployments.deployment_halt")
def deployment_halt(deployment_id: int) -> None:
    """On a node: stop a deployment's engine."""
    watch.deployment_halt(deployment_id)


@shared_task(name="deployments.deployment_forget")
def deployment_forget(deployment_id: int) -> None:
    """On a node: remove a deleted deployment's systemd unit, then the deployment."""
    watch.deployment_forget(deployment_id)


@shared_task(name="deployments.deployment_persist")
def deployment_persist(deployment_id: int) -> None:
    """On a node: install a deployment as a systemd unit."""
    persist.deployment_persist_here(deployment_id)


@shared_task(name="deployments.deployment_sleep")
def deployment_sleep(deployment_id: int, level: int | None = None) -> None:
    """On a node: put a sleep-mode deployment to sleep (level None: chosen by free host RAM)."""
    sleep.deployment_sleep_here(deployment_id, level)


@shared_task(name="deployments.deployment_sleep_probe")
def deployment_sleep_probe(deployment_id: int) -> None:
    """On a node: sleep a ready sleep-mode deployment at each level and wake it, proving its sleep or not."""
    sleep.deployment_sleep_probe_here(deployment_id)


@shared_task(name="deployments.deployment_wake")
def deployment_wake(deployment_id: int) -> None:
    """On a node: wake a sleeping deployment."""
    sleep.deployment_wake_here(deployment_id)


@shared_task(name="deployments.deployment_swap")
def deployment_swap(source_id: int, target_id: int) -> None:
    """On a node: the serving deployment sleeps, the sleeping one on its GPUs wakes."""
    sleep.deployment_swap_here(source_id, target_id)


@shared_task(name="deployments.node_measure_disk")
def node_measure_disk(node_id: int) -> None:
    """On a node: measure the model store's sequential read rate."""
    loads.node_measure_disk(node_id)


@shared_task(name="deployments.rank_run")
def rank_run(rank_id: int) -> None:
    """On a worker node: prepare, pre-flight and launch its rank of a multi-node deployment ."""
    ranks.rank_run(rank_id)


@shared_task(name="deployments.rank_halt")
def rank_halt(rank_id: int) -> None:
    """On a worker node: stop its rank of a multi-node deployment."""
    ranks.rank_halt(rank_id)


@shared_task(name="deployments.rank_forget")
def rank_forget(rank_id: int) -> None:
    """On a worker node: remove a deleted persisted deployment's rank unit."""
    ranks.rank_forget(rank_id)


@shared_task(name="deployments.deployment_rank_lost")
def deployment_rank_lost(deployment_id: int, rank_id: int) -> None:
    """On the head's node: a worker rank died; fail the whole deployment."""
    ranks.deployment_rank_lost(deployment_id, rank_id)
