"""A user's own notification settings: channels (added, removed, tested), subscriptions and quiet hours. Views
and the API validate and call these; every check that says who may do what is here, once."""
import secrets
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.core.validators import EmailValidator, URLValidator
from django.db import transaction

from controlpanel import roles
from deployments import sealed
from deployments.models import Deployment, Node
from deployments.notify import alerts, catalog
from deployments.notify.models import Channel, Delivery, QuietHours, Subscription

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
