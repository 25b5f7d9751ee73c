"""Sending host work to a node's own queue, by task name: the plan, a rank's halt, any host task. Beneath
both sides: the control plane sends what a user asked for, the node sends what a crash or a failure needs
(an auto-restart's plan, every other rank's halt)."""
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from deployments.models import Deployment, DeploymentRank, Node
from plumbing.queue import enqueue

__all__ = ["node_enqueue", "send_plan", "ranks_stop"]


def node_enqueue(node: Node, task_name: str, *args) -> None:
    """Send a host task (by name) to the node's own queue once the current transaction commits."""
    # The expiry drops work a node that was offline would run days later; the agent re-queues at
    # its start what it still owes (unfinished downloads and stops), from the rows.
    enqueue(task_name, args=list(args), queue=node.queue, expires=settings.HOST_TASK_EXPIRES_S)


def send_plan(d: Deployment, countdown: int = 0) -> None:
    """Queue the plan with an expiry: a node that comes back later does nothing (the row says so)."""
    expires = settings.HOST_TASK_EXPIRES_S + countdown
    d.expires_at = timezone.now() + timedelta(seconds=expires)
    Deployment.objects.filter(pk=d.pk).update(expires_at=d.expires_at)
    enqueue("deployments.deployment_run", args=[d.pk], queue=d.node.queue, countdown=countdown, expires=expires)


def ranks_stop(d: Deployment) -> int:
    """Stop every worker rank of a multi-node deployment still on, each on its own node's queue (Stop, a
    failure or a crash of any rank ends them all); how many were asked."""
    asked = 0
    for r in d.ranks.select_related("node").exclude(state__in=DeploymentRank.ENDED):
        DeploymentRank.objects.filter(pk=r.pk).exclude(state__in=DeploymentRank.ENDED).update(
            state=DeploymentRank.State.STOPPING)
        enqueue("deployments.rank_halt", args=[r.pk], queue=r.node.queue)
        asked += 1
    return asked
