"""What the node gateways need from the database: callers' keys, routes (names and admission bounds per
deployment) and usage by hour. The gateways load keys and routes into memory and reload them when
`deployments.gateway.changes` says something changed, so no request waits on the database."""
from django.conf import settings
from django.db import models


class CallerKey(models.Model):
    """A key a caller sends to a node gateway (`Authorization: Bearer vcp-…`). The secret is shown once;
    only its SHA-256 digest is kept (the secret is 32 random bytes, so a fast digest is the right hash,
    as for GitHub's tokens). Empty scopes allow every model name and deployment."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="caller_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The first characters of the secret, shown in lists.")
    digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the secret, hex.")
    model_names = models.JSONField(default=list, blank=True, help_text="Model names this key may call; empty: any.")
    deployments = models.ManyToManyField("deployments.Deployment", blank=True, related_name="caller_keys",
                                         help_text="Deployments this key may call; none: any.")
    expires_at = models.DateTimeField(null=True, blank=True)
    rps_limit = models.FloatField(null=True, blank=True, help_text="Requests per second (a token bucket); empty: none.")
    tpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="Tokens (prompt + output) per minute; empty: none.")
    max_concurrency = models.PositiveIntegerField(null=True, blank=True, help_text="Requests in flight at once; empty: none.")
    internal = models.BooleanField(default=False, help_text="The panel's own: gateway to gateway, Prometheus scrapes.")
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"


class Route(models.Model):
    """How a gateway reaches one deployment: the extra model names it answers to (aliases, besides its
    served name), its admission bounds and the domains its multimodal URLs may come from."""

    deployment = models.OneToOneField("deployments.Deployment", on_delete=models.CASCADE, related_name="route")
    names = models.JSONField(default=list, blank=True, help_text="Aliases: model names callers may use for it.")
    max_in_flight = models.PositiveIntegerField(null=True, blank=True,
                                                help_text="Requests sent to the engine at once; empty: its --max-num-seqs.")
    queue_bound = models.PositiveIntegerField(default=256, help_text="Requests waiting in the gateway beyond that; then 429.")
    media_domains = models.JSONField(default=list, blank=True,
                                     help_text="Domains multimodal URLs may come from; empty: no URLs, data: only.")

    def __str__(self):
        return f"route of {self.deployment_id}"


class Usage(models.Model):
    """What callers used in one hour: one row per (hour, key, model name, deployment) as a gateway flushes
    its counters (two gateways may each add a row for the same group; readers always sum)."""

    hour = models.DateTimeField(db_index=True, help_text="The hour's start, UTC.")
    key = models.ForeignKey(CallerKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="usage")
    model_name = models.CharField(max_length=200)
    deployment = models.ForeignKey("deployments.Deployment", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="usage")
    requests = models.BigIntegerField(default=0)
    errors = models.BigIntegerField(default=0)
    refused = models.BigIntegerField(default=0, help_text="Of the errors, 429s: refused for load (a key's limit, a "
                                     "deployment's queue bound, the engine's own admission cap); try again later.")
    prompt_tokens = models.BigIntegerField(default=0)
    reasoning_tokens = models.BigIntegerField(default=0)
    content_tokens = models.BigIntegerField(default=0)

    class Meta:
        indexes = [models.Index(fields=["key", "hour"]), models.Index(fields=["deployment", "hour"])]
