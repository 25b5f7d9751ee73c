"""Load time, control side: asking a node to measure its model store's read rate. What the node
measures (a load's phases and prediction, pre-warm, the store's rate) is deployments/loads.py, beneath both
sides; its names are read here too by the control plane's callers."""
from deployments.loads import (LoadWatch, Prewarm, load_history, load_key, load_recommendation,  # noqa: F401
                               node_measure_disk, node_measure_disk_once)
from deployments.models import Node
from deployments.services.nodes import node_enqueue

__all__ = ["node_measure_disk_request"]


def node_measure_disk_request(node: Node) -> None:
    """Queue a measurement of the store's read rate on the node (on demand)."""
    node_enqueue(node, "deployments.node_measure_disk", node.pk)
