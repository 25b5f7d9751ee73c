"""Celery tasks: thin wrappers that load by ID and call a service.

Host tasks are sent to the node's own queue (`node.<name>`) by the service that enqueues them.
"""
import platform
import socket

from celery import shared_task


@shared_task(name="deployments.node_ping")
def node_ping() -> dict:
    """Answer from whichever agent ran it: proves routing to a node's queue reaches that node."""
    from django.conf import settings

    return {"hostname": socket.gethostname(), "node": getattr(settings, "NODE_NAME", ""), "python": platform.python_version()}
