"""The key Prometheus scrapes the engines with: engines listen on loopback, so Prometheus reaches each
one's /metrics through its node's gateway (`/engines/<deployment id>/metrics`), which answers internal keys only.

Prometheus already holds one secret of the panel's, the scrape token (METRICS_TOKEN, a credentials_file in
monitoring/prometheus.yml); the gateways know keys by digest only. So the panel keeps one internal CallerKey
whose digest is the scrape token's: Prometheus sends the same file to the panel and to every gateway, and a new
token (or none) revokes the old key on every gateway within a second (gateway/changes.py). It is kept in step
by the service discovery view, which Prometheus asks before it scrapes any engine it lists.
"""
import hashlib

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from deployments.gateway import changes, config
from deployments.gateway.models import CallerKey

NAME = config.SCRAPE_KEY_NAME
PREFIX = "(scrape token)"  # not the secret's first characters: the token is the panel's own


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _owner():
    users = get_user_model().objects.order_by("pk")
    return users.filter(is_superuser=True).first() or users.first()


def ensure() -> CallerKey | None:
    """The internal key matching METRICS_TOKEN now (made or taken back into use), any other one revoked; None
    without a token (or without any user to own the key yet)."""
    token = settings.METRICS_TOKEN
    ours = CallerKey.objects.filter(internal=True, name=NAME)
    want = digest(token) if token else None
    if want and ours.filter(digest=want, revoked_at=None).exists() and not ours.exclude(digest=want).filter(
            revoked_at=None).exists():
        return ours.get(digest=want)  # the usual case: one read, nothing to tell the gateways
    with transaction.atomic():
        stale = ours.filter(revoked_at=None)
        if want:
            stale = stale.exclude(digest=want)
        stale.update(revoked_at=timezone.now())
        key = None
        owner = _owner() if want else None
        if owner is not None:
            key, _ = CallerKey.objects.get_or_create(digest=want, defaults={
                "owner": owner, "name": NAME, "prefix": PREFIX, "internal": True})
            if not (key.internal and key.name == NAME):
                raise RuntimeError("METRICS_TOKEN's digest belongs to a caller key: choose another scrape token")
            if key.revoked_at is not None:
                CallerKey.objects.filter(pk=key.pk).update(revoked_at=None)
                key.revoked_at = None
    transaction.on_commit(lambda: changes.changed("keys"))
    return key
