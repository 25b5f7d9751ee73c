"""Sending a delivery: claim the row, send outside any transaction, log the attempt, then sent, or due again
after a backoff, or (out of retries, or a permanent refusal) failed with its channel marked failing.

A claim is a conditional UPDATE, so two workers (a task and the sweep's copy of it) never both send; a claim
expires, so a worker killed mid-send leaves the row to the next sweep. Rows are the queue: a panel restarted
with messages pending sends them when the sweep (schedule.py) runs."""
import logging
import os
from datetime import timedelta

from django.conf import settings
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from deployments.notify import alerts, senders
from deployments.notify.models import Attempt, Channel, Delivery

log = logging.getLogger(__name__)
CLAIM = timedelta(seconds=60)  # above senders.TIMEOUT_S: a claim outlives any one send


def retry_base_s() -> float:
    return alerts.setting("NOTIFY_RETRY_BASE_S", 15)


def max_attempts() -> int:
    return int(alerts.setting("NOTIFY_MAX_ATTEMPTS", 8))  # 15 s doubling: ~30 min of retries in all


def message(delivery: Delivery) -> senders.Message:
    """What the delivery says, read when it is sent (a condition's folded events included)."""
    base = (getattr(settings, "PANEL_URL", "") or os.environ.get("PANEL_URL", "")).rstrip("/")  # links in messages
    if delivery.phase == Delivery.Phase.TEST:
        return senders.Message(delivery=delivery.pk, event="test", phase="test", severity="info",
                               title=f"Test message to {delivery.channel.name}",
                               text="If you read this, the panel can reach this channel.",
                               url=f"{base}{reverse('notify-page')}" if base else "")
    alert = delivery.alert
    d, node = alert.deployment, alert.node
    text = alert.body
    if alert.count > 1:
        text += f"\n({alert.count} events folded into this alert: {', '.join(alert.data.get('kinds', []))}.)"
    if delivery.phase == Delivery.Phase.RESOLVED:
        text = f"{alert.resolve_note} Firing since {alert.started:%Y-%m-%d %H:%M} UTC, {alert.count} event(s)."
    page = (reverse("run-detail", args=[alert.data["run"]]) if alert.kind == "benchmark_finished" else
            reverse("study-detail", args=[alert.data["study"]]) if alert.kind == "study_finished" else
            reverse("deployment-detail", args=[d.pk]) if d is not None else
            reverse("node-detail", args=[node.pk]) if node is not None else reverse("notify-page"))
    url = f"{base}{page}" if base else ""
    return senders.Message(
        delivery=delivery.pk, event=alert.kind, phase=delivery.phase, severity=alert.severity, title=alert.title, text=text,
        url=url, deployment={"id": d.pk, "name": d.name} if d is not None else None,
        node={"id": node.pk, "name": node.name} if node is not None else None,
        data={k: v for k, v in alert.data.items() if k != "kinds"} | {"alert": alert.pk, "count": alert.count})


def delivery_send(delivery_id: int) -> str:
    """Send one delivery if it is due and nobody else is sending it; say what happened."""
    now = timezone.now()
    claimed = (Delivery.objects.filter(pk=delivery_id, status=Delivery.Status.PENDING, due__lte=now)
               .filter(Q(claimed_until=None) | Q(claimed_until__lt=now)).update(claimed_until=now + CLAIM))
    if not claimed:
        return "not due"
    delivery = Delivery.objects.select_related("channel", "alert__deployment", "alert__node").get(pk=delivery_id)
    if delivery.phase == Delivery.Phase.RESOLVED and Delivery.objects.filter(
            alert=delivery.alert_id, channel=delivery.channel_id, phase=Delivery.Phase.FIRING,
            status=Delivery.Status.PENDING).exists():
        # The resolve follows its firing message, never overtakes it (a receiver that was down gets both, in order).
        Delivery.objects.filter(pk=delivery_id).update(claimed_until=None, due=now + timedelta(seconds=retry_base_s()))
        alerts.enqueue(Delivery.objects.get(pk=delivery_id))
        return "after its firing message"
    channel = delivery.channel
    try:
        code = senders.send(channel.kind, channel.address, channel.key, message(delivery))
        error, permanent = "", False
    except senders.SendError as exc:
        code, error, permanent = exc.status_code, str(exc), exc.permanent
    Attempt.objects.create(delivery=delivery, status_code=code, error=error, ok=not error)
    attempts = delivery.attempts + 1
    if not error:
        Delivery.objects.filter(pk=delivery_id).update(status=Delivery.Status.SENT, sent=timezone.now(), attempts=attempts,
                                                       status_code=code, error="", claimed_until=None)
        Channel.objects.filter(pk=channel.pk, failing=True).update(failing=False, last_error="")
        return "sent"
    if permanent or attempts >= max_attempts():
        Delivery.objects.filter(pk=delivery_id).update(status=Delivery.Status.FAILED, attempts=attempts, status_code=code,
                                                       error=error[:500], claimed_until=None)
        Channel.objects.filter(pk=channel.pk).update(failing=True, last_error=error[:500])
        log.warning("notification %s to channel %s failed for good: %s", delivery_id, channel.pk, error)
        return "failed"
    due = timezone.now() + timedelta(seconds=min(3600.0, retry_base_s() * 2 ** (attempts - 1)))
    Delivery.objects.filter(pk=delivery_id).update(attempts=attempts, status_code=code, error=error[:500], due=due,
                                                   claimed_until=None)
    delivery.due = due
    alerts.enqueue(delivery)
    return "retry"


def deliveries_due() -> int:
    """Enqueue every pending delivery that is due and unclaimed (after a restart, a lost task); how many."""
    now = timezone.now()
    due = list(Delivery.objects.filter(status=Delivery.Status.PENDING, due__lte=now)
               .filter(Q(claimed_until=None) | Q(claimed_until__lt=now)).values_list("pk", flat=True)[:500])
    for pk in due:
        alerts.queue.enqueue(alerts.DELIVER_TASK, args=[pk])
    return len(due)
