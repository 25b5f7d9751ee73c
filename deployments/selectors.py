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
