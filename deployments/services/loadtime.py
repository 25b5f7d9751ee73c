"""Load time, control side: asking a node to measure its model store's read rate. What the node
measures (a load's phases and prediction, pre-warm, the store's rate) is deployments/loads.py, beneath both
sides."""
from deployments.models import Node
from deployments.dispatch import node_enqueue

__all__ = ["node_measure_disk_request"]


def node_measure_disk_request(node: Node) -> None:
    """Queue a measurement of the store's read rate on the node (on demand)."""
    node_enqueue(node, "deployments.node_measure_disk", node.pk)
