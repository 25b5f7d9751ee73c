"""A deployment's timeline: one event per step or moment, pushed to its page. Beneath both sides: the
control plane (deploys.py) and the node (deployments/node/) write it through this module alone."""
from django.utils import timezone

from deployments import payloads, secrets
from deployments.models import Deployment, DeploymentEvent

# The status message of a deployment a plan stopped for another (node/steps.make_room), followed by the other's name:
# its subscribers are told who took its GPUs (notify/events.py).
MADE_ROOM_FOR = "stopped to make room for "

__all__ = ["deployment_event"]


def deployment_event(d: Deployment, step: str, message: str = "", level: str = "info", ongoing: bool = False,
                     **data) -> DeploymentEvent:
    """Add a step to the timeline and push it to the page. Only an `ongoing` step is ended later; any other
    event is a moment (queued, stop requested, failed), ended as it starts, so no row shows "…" forever."""
    now = timezone.now()
    message = secrets.redact_deployment(d, message)  # messages quote engine log lines, which may carry secrets
    event = DeploymentEvent.objects.create(deployment=d, step=step, message=message, level=level, data=data,
                                           started=now, ended=None if ongoing else now)
    payloads.send_timeline_step(event)
    return event
