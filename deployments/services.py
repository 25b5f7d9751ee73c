"""Writes that span models, the queue, the channel layer or a host."""
import logging

from django.db import transaction
from django.utils import timezone

from deployments import live
from deployments.models import Gpu, Node

log = logging.getLogger(__name__)


@transaction.atomic
def node_register(*, name: str, address: str, agent_version: str, model_store: str, heartbeat_seconds: float,
                  gpus: list, nvml_error: str = "") -> Node:
    """Create or update a node and its GPU rows from what its agent found at start."""
    node, _ = Node.objects.select_for_update().get_or_create(name=name)
    node.address = address
    node.agent_version = agent_version
    node.model_store = model_store
    node.heartbeat_seconds = heartbeat_seconds
    node.nvml_error = nvml_error
    node.last_heartbeat = timezone.now()
    node.save()
    seen = []
    for info in gpus:
        Gpu.objects.update_or_create(
            node=node, index=info.index,
            defaults={"uuid": info.uuid, "name": info.name, "memory_total": info.memory_total,
                      "compute_capability": info.compute_capability or ""},
        )
        seen.append(info.index)
    node.gpus.exclude(index__in=seen).filter(deployments__isnull=True).delete()
    return node


def node_heartbeat(node_id: int, *, disk_total: int | None = None, disk_free: int | None = None) -> None:
    """Record that a node's agent is alive, with its model store's disk figures."""
    fields = {"last_heartbeat": timezone.now()}
    if disk_total is not None:
        fields.update(disk_total=disk_total, disk_free=disk_free)
    Node.objects.filter(pk=node_id).update(**fields)
    live.publish(live.node_topic(node_id), "heartbeat", {"at": fields["last_heartbeat"].isoformat()})


def node_sample_record(node_id: int, sample: dict) -> None:
    """Push one host sample to the browsers watching the node and the fleet."""
    live.publish(live.node_topic(node_id), "sample", sample)
