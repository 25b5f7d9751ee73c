"""A user's own notification settings: channels (added, removed, tested), subscriptions and quiet hours; and the
deployments' service-level objectives (an operator's). Views and the API validate and call these; every check
that says who may do what is here, once."""
import secrets
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.core.validators import EmailValidator, URLValidator
from django.db import transaction

from deployments import sealed
from deployments.models import Deployment, Node
from deployments.notify import alerts, catalog
from deployments.notify.models import Channel, Delivery, QuietHours, Slo, Subscription
from plumbing import roles

WEBHOOK_KINDS = frozenset({Channel.Kind.WEBHOOK, Channel.Kind.SLACK, Channel.Kind.MATRIX})


class NotifyError(Exception):
    """Bad input or not allowed, with the message to show; `forbidden`: a role is missing (403, not 400);
    `missing`: the channel or subscription named is not the user's (404)."""

    def __init__(self, message: str, forbidden: bool = False, missing: bool = False):
        super().__init__(message)
        self.forbidden = forbidden
        self.missing = missing


def _need_role(user) -> None:
    if not roles.is_viewer(user):
        raise NotifyError("Notifications need a role (viewer, operator or admin).", forbidden=True)


def channel_add(user, kind: str, name: str, target: str) -> tuple[Channel, str]:
    """A new channel of `user`; for a generic webhook also its signing key, returned this once.

    Webhooks make the panel send requests to a URL someone typed, as benchmark URLs do: admins only."""
    _need_role(user)
    if kind not in Channel.Kind.values:
        raise NotifyError(f"Unknown channel kind {kind!r}: one of {', '.join(Channel.Kind.values)}.")
    name, target = (name or "").strip()[:80], (target or "").strip()
    if not name:
        raise NotifyError("Give the channel a name.")
    if kind == Channel.Kind.EMAIL:
        try:
            EmailValidator()(target)
        except ValidationError:
            raise NotifyError(f"{target!r} is not an e-mail address.") from None
    else:
        if not roles.is_admin(user):
            raise NotifyError("Webhook channels need the admin role (the panel sends requests to the URL).", forbidden=True)
        try:
            URLValidator(schemes=["http", "https"])(target)
        except ValidationError:
            raise NotifyError("The webhook URL must be an http:// or https:// URL.") from None
        if len(target) > 600 or urlsplit(target).username:
            raise NotifyError("The webhook URL is too long or carries a user name.")
    key = secrets.token_urlsafe(32) if kind == Channel.Kind.WEBHOOK else ""
    channel = Channel(user=user, kind=kind, name=name)
    channel.set_address(target)
    if key:
        channel.secret = sealed.seal(key)
    channel.save()
    return channel, key


def channel_get(user, channel_id: int) -> Channel:
    channel = Channel.objects.filter(pk=channel_id, user=user).first()
    if channel is None:
        raise NotifyError("No such channel of yours.", missing=True)
    return channel


def channel_remove(user, channel_id: int) -> None:
    channel_get(user, channel_id).delete()


def channel_test(user, channel_id: int) -> Delivery:
    """Send a test message to one of the user's channels now (its result shows in the delivery log)."""
    _need_role(user)
    with transaction.atomic():
        return alerts.delivery_test(channel_get(user, channel_id))


def subscription_add(user, kinds: list[str], deployment_id=None, node_id=None, team_id=None) -> Subscription:
    """Subscribe `user` (or their team: a group they are in; admins: any group) to `kinds` (all when empty), for
    one deployment or node, or for everything."""
    _need_role(user)
    team = None
    if team_id:
        team = Group.objects.filter(pk=team_id).first()
        if team is None or not (roles.is_admin(user) or user.groups.filter(pk=team_id).exists()):
            raise NotifyError("No such team of yours (a group you are a member of).")
    unknown = sorted(set(kinds) - set(catalog.SUBSCRIBABLE))
    if unknown:
        raise NotifyError(f"Unknown event kinds: {', '.join(unknown)}; known: {', '.join(catalog.SUBSCRIBABLE)}.")
    if deployment_id and node_id:
        raise NotifyError("Subscribe to a deployment or to a node, not both.")
    deployment = Deployment.objects.filter(pk=deployment_id).first() if deployment_id else None
    node = Node.objects.filter(pk=node_id).first() if node_id else None
    if (deployment_id and deployment is None) or (node_id and node is None):
        raise NotifyError("No such deployment or node.")
    return Subscription.objects.create(user=user, team=team, kinds=sorted(set(kinds)), deployment=deployment, node=node)


def subscription_remove(user, subscription_id: int) -> None:
    if not Subscription.objects.filter(pk=subscription_id, user=user).delete()[0]:
        raise NotifyError("No such subscription of yours.", missing=True)


def quiet_hours_set(user, start, end, tz: str = "UTC") -> QuietHours | None:
    """Quiet hours from `start` to `end` in `tz` (None for either: none); critical messages still go."""
    _need_role(user)
    if start is None or end is None:
        QuietHours.objects.filter(user=user).delete()
        return None
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise NotifyError(f"Unknown time zone {tz!r} (an IANA name, e.g. Europe/Berlin).") from None
    quiet, _ = QuietHours.objects.update_or_create(user=user, defaults={"start": start, "end": end, "tz": tz})
    return quiet


SLO_MAX_MINUTES = 24 * 60


def slo_set(user, deployment_id: int | None, ttft_p95_ms: int | None, error_pct: float | None,
            minutes: int = 5, refused_pct: float | None = None) -> Slo:
    """Set a deployment's objectives (operators): TTFT p95 at most `ttft_p95_ms`, at most `error_pct` % of
    requests aborted or failed, at most `refused_pct` % refused for load by the engine's admission caps, a breach
    told once it has lasted `minutes` (0: at the first check)."""
    if not roles.is_operator(user):
        raise NotifyError("Setting objectives needs the operator role.", forbidden=True)
    if ttft_p95_ms is None and error_pct is None and refused_pct is None:
        raise NotifyError("Give a TTFT p95 objective (ms), an error-rate objective (%), a refused-for-load objective "
                          "(%), or several.")
    if ttft_p95_ms is not None and not 1 <= ttft_p95_ms <= 3_600_000:
        raise NotifyError("The TTFT p95 objective is in milliseconds, from 1 to 3,600,000.")
    if error_pct is not None and not 0 <= error_pct < 100:
        raise NotifyError("The error-rate objective is a percentage from 0 to below 100.")
    if refused_pct is not None and not 0 <= refused_pct < 100:
        raise NotifyError("The refused-for-load objective is a percentage from 0 to below 100.")
    if not 0 <= minutes <= SLO_MAX_MINUTES:
        raise NotifyError(f"A breach is told after 0 to {SLO_MAX_MINUTES} minutes.")
    deployment = Deployment.objects.filter(pk=deployment_id).first() if deployment_id else None
    if deployment is None:
        raise NotifyError("No such deployment.", missing=True)
    slo, _ = Slo.objects.update_or_create(deployment=deployment, defaults={
        "ttft_p95_ms": ttft_p95_ms, "error_pct": error_pct, "refused_pct": refused_pct, "minutes": minutes,
        "breach_since": None})
    return slo


def slo_remove(user, deployment_id: int) -> None:
    """Drop a deployment's objectives (operators); a breach they fired is resolved."""
    if not roles.is_operator(user):
        raise NotifyError("Removing objectives needs the operator role.", forbidden=True)
    with transaction.atomic():
        slo = Slo.objects.select_related("deployment").filter(deployment_id=deployment_id).first()
        if slo is None:
            raise NotifyError("That deployment has no objectives.", missing=True)
        alerts.alert_resolve("slo", "Its objectives were removed.", deployment=slo.deployment)
        slo.delete()
