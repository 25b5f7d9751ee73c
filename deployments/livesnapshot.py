"""What a browser gets when it subscribes to a topic: the kept snapshot (deployments/live.py), and for a
deployment whose kept status is gone (Redis restarted empty keeps nothing) its status and timeline read
from the database, so a page that reconnects after the restart redraws what is true, not what it had."""
from dataclasses import asdict

from deployments import live
from deployments.models import Deployment, DeploymentEvent

TIMELINE_STEPS = 200  # the newest ones; a deploy's timeline has a few dozen


def on_subscribe(topic: str) -> list[live.LiveMessage]:
    messages = live.snapshot(topic)
    if topic.startswith("deployment:") and not any(m["kind"] == "status" for m in messages):
        messages += _deployment_from_database(int(topic.split(":")[1]))
    return messages


def _deployment_from_database(deployment_id: int) -> list[live.LiveMessage]:
    d = Deployment.objects.filter(pk=deployment_id).first()
    if d is None:
        return []
    topic = live.deployment_topic(d.pk)
    events = DeploymentEvent.objects.filter(deployment=d).order_by("-started", "-pk")[:TIMELINE_STEPS]
    return [{"topic": topic, "kind": "status", "data": asdict(live.DeploymentStatus.of(d))}] + [
        {"topic": topic, "kind": f"event.{e.pk}", "data": asdict(live.TimelineStep.of(e))} for e in reversed(events)]
