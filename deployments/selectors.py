"""Reads for pages and the API."""
from django.db.models import Prefetch, QuerySet

from deployments.models import Deployment, Gpu, ModelCopy, ModelRepo, Node


def node_list() -> QuerySet[Node]:
    active = Deployment.objects.filter(status__in=Deployment.ACTIVE).select_related("model")
    return Node.objects.prefetch_related("gpus", Prefetch("deployments", queryset=active, to_attr="active_deployments"))


def model_list() -> QuerySet[ModelRepo]:
    return ModelRepo.objects.prefetch_related(Prefetch("copies", queryset=ModelCopy.objects.select_related("node")))


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("model", "node").prefetch_related("gpus")


def gpus_of(node: Node) -> QuerySet[Gpu]:
    return node.gpus.all()


def deployment_events_after(deployment: Deployment, after: int, wait_s: float = 0.0) -> list:
    """Events newer than `after`; waits up to `wait_s` for one to appear (a long poll)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        events = list(deployment.events.filter(pk__gt=after))
        if events or time.monotonic() >= deadline:
            return events
        time.sleep(0.5)
