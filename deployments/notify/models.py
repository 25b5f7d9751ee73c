"""Who hears of what and how: channels, subscriptions, quiet hours; alerts (what happened) and deliveries
(one message to one channel, a row until it is sent, so a restart loses nothing)."""
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models
from django.utils import timezone

from deployments import sealed
from deployments.models import Deployment, Node
from deployments.notify import catalog


class Channel(models.Model):
    """Where one user's messages go: an e-mail address, a generic webhook (JSON, HMAC-signed), or a Slack- or
    Matrix-compatible incoming webhook."""

    class Kind(models.TextChoices):
        EMAIL = "email", "E-mail"
        WEBHOOK = "webhook", "Webhook (JSON, signed)"
        SLACK = "slack", "Slack incoming webhook"
        MATRIX = "matrix", "Matrix incoming webhook"

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notify_channels")
    kind = models.CharField(max_length=8, choices=Kind.choices)
    name = models.CharField(max_length=80)
    target = models.CharField(max_length=1000, help_text="The e-mail address, or the webhook's URL (sealed at rest: a "
                              "Slack or Matrix hook's URL is its credential).")
    secret = models.CharField(max_length=256, blank=True, help_text="Webhooks: the HMAC-SHA256 key, sealed; never shown again.")
    enabled = models.BooleanField(default=True)
    failing = models.BooleanField(default=False, help_text="The last message ran out of retries.")
    last_error = models.CharField(max_length=500, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["user", "name"]

    def __str__(self):
        return f"{self.name} ({self.get_kind_display()})"

    @property
    def address(self) -> str:
        """Where it sends: the address, or the webhook URL unsealed (for the sender only)."""
        return self.target if self.kind == self.Kind.EMAIL else sealed.unseal(self.target)

    @property
    def shown(self) -> str:
        """What pages and the API show: the address, or a webhook's scheme and host only."""
        if self.kind == self.Kind.EMAIL:
            return self.target
        parts = urlsplit(self.address)
        return f"{parts.scheme}://{parts.hostname}/…"

    def set_address(self, address: str) -> None:
        self.target = address if self.kind == self.Kind.EMAIL else sealed.seal(address)

    @property
    def key(self) -> str:
        return sealed.unseal(self.secret) if self.secret else ""


class Subscription(models.Model):
    """A user (or every member of a team, a group) wants to hear of these kinds (all when empty), about one
    deployment or node, or about all. Each member hears it on their own channels."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notify_subscriptions",
                             help_text="Who made it; its recipient unless it is a team's.")
    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.CASCADE, related_name="notify_subscriptions",
                             help_text="A team (group): every member hears of it.")
    kinds = models.JSONField(default=list, blank=True, help_text="Event kinds (catalog.SUBSCRIBABLE); empty: all.")
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["user", "id"]

    def matches(self, kind: str, deployment_id, node_id) -> bool:
        if self.kinds and kind not in self.kinds:
            return False
        if self.deployment_id and self.deployment_id != deployment_id:
            return False
        return not self.node_id or self.node_id == node_id


class QuietHours(models.Model):
    """A user's quiet hours: messages (but critical ones) wait until they end. start > end spans midnight."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="notify_quiet")
    start = models.TimeField()
    end = models.TimeField()
    tz = models.CharField(max_length=64, default="UTC", help_text="An IANA time zone, e.g. Europe/Berlin.")


class Slo(models.Model):
    """A deployment's service-level objectives, checked against its engine's own figures over the last 5
    minutes (TTFT p95, the share of requests aborted or failed, the share refused for load): a breach that lasts `minutes` is told once as
    slo_breached, and resolved when both are met again. Operators set them; everyone sees them."""

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE, related_name="slo")
    ttft_p95_ms = models.PositiveIntegerField(null=True, blank=True, help_text="TTFT p95 at most this (ms).")
    error_pct = models.FloatField(null=True, blank=True, help_text="At most this share of requests aborted or failed (%).")
    refused_pct = models.FloatField(null=True, blank=True, help_text="At most this share of requests the engine refused "
                                    "for load (its admission caps, --max-num-queued-reqs/-tokens) (%).")
    minutes = models.PositiveSmallIntegerField(default=5, help_text="How long a breach lasts before it is told.")
    breach_since = models.DateTimeField(null=True, blank=True, help_text="When the current breach began.")
    updated = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"SLO of {self.deployment}"


class Alert(models.Model):
    """Something worth telling about one deployment or node: a moment, or a condition that fires (events of
    its group folded in, `count`) until it resolves."""

    kind = models.CharField(max_length=32, choices=catalog.CHOICES)
    severity = models.CharField(max_length=8, default=catalog.INFO)
    group_key = models.CharField(max_length=120, blank=True, help_text="Conditions: group:subject; blank for a moment.")
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    title = models.CharField(max_length=300)
    body = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    count = models.PositiveIntegerField(default=1, help_text="Events folded into it.")
    started = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now)
    resolved = models.DateTimeField(null=True, blank=True)
    resolve_note = models.TextField(blank=True)

    class Meta:
        ordering = ["-started", "-id"]
        indexes = [models.Index(fields=["group_key", "resolved"], name="notify_alert_open")]

    def __str__(self):
        return self.title

    @property
    def firing(self) -> bool:
        return bool(self.group_key) and self.resolved is None


class Delivery(models.Model):
    """One message (an alert firing or resolving, or a channel's test) to one channel; sent by a task."""

    class Phase(models.TextChoices):
        FIRING = "firing", "Firing"
        RESOLVED = "resolved", "Resolved"
        TEST = "test", "Test"

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        SENT = "sent", "Sent"
        FAILED = "failed", "Failed"

    alert = models.ForeignKey(Alert, null=True, blank=True, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.ForeignKey(Channel, on_delete=models.CASCADE, related_name="deliveries")
    phase = models.CharField(max_length=8, choices=Phase.choices)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    due = models.DateTimeField(default=timezone.now, help_text="Not sent before (quiet hours, backoff).")
    claimed_until = models.DateTimeField(null=True, blank=True, help_text="A worker sends it until then.")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    sent = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created", "-id"]
        indexes = [models.Index(fields=["status", "due"], name="notify_delivery_due")]
        constraints = [models.UniqueConstraint(fields=["alert", "channel", "phase"], name="notify_one_per_phase",
                                               condition=models.Q(alert__isnull=False))]


class Attempt(models.Model):
    """The delivery log: one try, its HTTP status code (or SMTP's) and error."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="log")
    at = models.DateTimeField(default=timezone.now)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True)
    ok = models.BooleanField(default=False)

    class Meta:
        ordering = ["delivery", "at", "id"]
