"""Alerts and their deliveries: raise (a moment, or a condition that folds repeats), resolve, and the rows each
subscribed channel gets. Runs inside the caller's transaction: the rows exist exactly when the event's do, and
the send tasks are enqueued on commit, so nothing here waits on a mail server or a webhook."""
import datetime as dt
import logging
import os
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from deployments.notify import catalog
from deployments.notify.models import Alert, Channel, Delivery, QuietHours, Subscription
from plumbing import queue, roles

log = logging.getLogger(__name__)
DELIVER_TASK = "notify.deliver"
RANK = {s: i for i, s in enumerate(catalog.SEVERITIES)}


def subject_key(deployment=None, node=None) -> str:
    return f"deployment:{deployment.pk}" if deployment is not None else f"node:{node.pk}" if node is not None else "panel"


def open_alert(group: str, deployment=None, node=None) -> Alert | None:
    """The firing alert of `group` for this deployment or node, locked, or None."""
    key = f"{group}:{subject_key(deployment, node)}"
    return Alert.objects.select_for_update().filter(group_key=key, resolved=None).order_by("-id").first()


def alert_raise(kind: str, *, deployment=None, node=None, title: str, body: str = "", data: dict | None = None,
                fold: bool = True) -> Alert:
    """Tell of `kind`: a new alert and its firing deliveries, or, for a condition already firing, the event
    folded into that alert (counted; a channel hears of it only if nothing of this alert reached it yet)."""
    spec = catalog.KINDS[kind]
    if node is None and deployment is not None:
        node = deployment.node
    now = timezone.now()
    if spec.group:
        current = open_alert(spec.group, deployment, node if deployment is None else None)
        if current is not None:
            if not fold:
                return current  # a periodic condition seen again: nothing new
            current.count += 1
            current.last_seen = now
            current.data = {**current.data, **(data or {}), "kinds": sorted({*current.data.get("kinds", []), kind})}
            if RANK[spec.severity] > RANK.get(current.severity, 0):  # a restart loop outranks the crash it began with
                current.severity, current.kind, current.title = spec.severity, kind, title
            current.save()
            deliveries_create(current, kind, Delivery.Phase.FIRING)
            return current
    alert = Alert.objects.create(
        kind=kind, severity=spec.severity, deployment=deployment, node=node, title=title[:300], body=body,
        data={**(data or {}), "kinds": [kind]}, started=now, last_seen=now,
        group_key=f"{spec.group}:{subject_key(deployment, node if deployment is None else None)}" if spec.group else "")
    deliveries_create(alert, kind, Delivery.Phase.FIRING)
    return alert


def alert_resolve(group: str, note: str, *, deployment=None, node=None) -> Alert | None:
    """End the firing alert of `group` (if any) and tell every channel that heard it fire."""
    alert = open_alert(group, deployment, node)
    if alert is None:
        return None
    alert.resolved = timezone.now()
    alert.resolve_note = note
    alert.save(update_fields=["resolved", "resolve_note"])
    for channel in Channel.objects.filter(deliveries__alert=alert, deliveries__phase=Delivery.Phase.FIRING).distinct():
        _delivery(alert, channel, Delivery.Phase.RESOLVED, critical=False)
    return alert


def recipients(kind: str, deployment_id, node_id) -> set:
    """Users subscribed to `kind` for this deployment or node who may see it (any role; no role: nothing)."""
    subs = (Subscription.objects.filter(Q(deployment=None) | Q(deployment_id=deployment_id))
            .filter(Q(node=None) | Q(node_id=node_id)).select_related("user", "team"))
    users = {}
    for sub in subs:
        if not sub.matches(kind, deployment_id, node_id):
            continue
        for user in (sub.team.user_set.all() if sub.team_id else [sub.user]):
            if user.is_active and roles.is_viewer(user):
                users[user.pk] = user
    return set(users.values())


def deliveries_create(alert: Alert, kind: str, phase: str) -> list[Delivery]:
    """A delivery to each enabled channel of each recipient of `kind` that has none for this alert yet."""
    users = recipients(kind, alert.deployment_id, alert.node_id)
    if not users:
        return []
    channels = Channel.objects.filter(user__in=users, enabled=True).select_related("user")
    critical = alert.severity == catalog.CRITICAL
    return [d for ch in channels if (d := _delivery(alert, ch, phase, critical)) is not None]


def delivery_test(channel: Channel) -> Delivery:
    """A test message to one channel, sent now whatever the quiet hours."""
    delivery = Delivery.objects.create(channel=channel, phase=Delivery.Phase.TEST)
    enqueue(delivery)
    return delivery


def _delivery(alert: Alert, channel: Channel, phase: str, critical: bool) -> Delivery | None:
    if Delivery.objects.filter(alert=alert, channel=channel, phase=phase).exists():
        return None
    due = timezone.now() if critical else quiet_until(channel.user, timezone.now())
    delivery = Delivery.objects.create(alert=alert, channel=channel, phase=phase, due=due)
    enqueue(delivery)
    return delivery


def enqueue(delivery: Delivery) -> None:
    """Send it once the transaction commits, at its due time (the sweep catches one whose task was lost)."""
    countdown = max(0.0, (delivery.due - timezone.now()).total_seconds())
    queue.enqueue(DELIVER_TASK, args=[delivery.pk], countdown=countdown)


def quiet_until(user, now: dt.datetime) -> dt.datetime:
    """When a message to `user` may go: now, or the end of their quiet hours if they are in them."""
    try:
        quiet = user.notify_quiet
    except QuietHours.DoesNotExist:
        return now
    try:
        zone = ZoneInfo(quiet.tz)
    except (ZoneInfoNotFoundError, ValueError):
        zone = dt.timezone.utc
    local = now.astimezone(zone)
    start, end, t = quiet.start, quiet.end, local.time()
    inside = (start <= t < end) if start <= end else (t >= start or t < end)
    if not inside or start == end:
        return now
    ends = local.replace(hour=end.hour, minute=end.minute, second=0, microsecond=0)
    if ends <= local:
        ends += dt.timedelta(days=1)
    return ends.astimezone(dt.timezone.utc)


def setting(name: str, default: float) -> float:
    """A NOTIFY_* tunable from the environment (tests shorten the backoff)."""
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        log.warning("%s=%r is not a number; using %s", name, os.environ.get(name), default)
        return default


def in_savepoint(fn, *args, **kwargs):
    """Run `fn` in a savepoint, logging (never raising) what goes wrong: telling of an event must never fail
    the plan, the agent or the request that wrote it."""
    try:
        with transaction.atomic():
            return fn(*args, **kwargs)
    except Exception:
        log.exception("notifications: %s failed; the event is not told", getattr(fn, "__name__", fn))
        return None
