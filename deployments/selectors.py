"""Reads for pages and the API."""
from django.db.models import Prefetch, QuerySet

from deployments.models import Deployment, ModelCopy, ModelRepo, Node


def node_list() -> QuerySet[Node]:
    active = Deployment.objects.filter(status__in=Deployment.ACTIVE).select_related("model")
    return Node.objects.prefetch_related("gpus", Prefetch("deployments", queryset=active, to_attr="active_deployments"))


def model_list() -> QuerySet[ModelRepo]:
    return ModelRepo.objects.prefetch_related(Prefetch("copies", queryset=ModelCopy.objects.select_related("node")))


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("model", "node").prefetch_related("gpus")


def deployment_progress(deployment: Deployment) -> tuple[str, list]:
    """A token that changes whenever the status, load progress or any timeline step changes, and the steps."""
    row = Deployment.objects.values("status", "load_percent").get(pk=deployment.pk)
    events = list(deployment.events.all())
    token = f"{row['status']}:{row['load_percent']}:" + ",".join(f"{e.pk}{'e' if e.ended else ''}" for e in events)
    return token, events


def deployment_wait(deployment: Deployment, token: str, wait_s: float = 0.0) -> tuple[str, list]:
    """The progress token and steps, once the token differs from `token` or `wait_s` has passed (a long poll)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        current, events = deployment_progress(deployment)
        if current != token or time.monotonic() >= deadline:
            return current, events
        time.sleep(0.5)
