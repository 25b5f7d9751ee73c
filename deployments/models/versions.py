"""Deploy versions: each deploy and redeploy of a deployment as it was resolved, and how it ended
(deployments/versions.py records and settles them); and the energy its GPUs drew, hour by hour."""

from django.conf import settings
from django.db import models

from deployments.models.engines import Deployment


class DeployVersion(models.Model):
    """One deploy or redeploy, immutable once recorded: the resolved request (flags, environment with secrets masked,
    GPUs, port, layout, model commit, engine version) and its outcome (ready in N s with its load steps, or failed
    with the reason). The last one that reached ready, smoke-tested, is the deployment's known good."""

    class Outcome(models.TextChoices):
        PENDING = "pending", "pending"
        READY = "ready", "ready"
        FAILED = "failed", "failed"
        STOPPED = "stopped", "stopped before ready"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    reason = models.CharField(max_length=200, help_text="deploy, redeploy, an advised retry, a rollback to vN, ...")
    request = models.JSONField(help_text="The resolved request (secret values masked).")
    outcome = models.CharField(max_length=8, choices=Outcome.choices, default=Outcome.PENDING)
    outcome_message = models.TextField(blank=True)
    ready_seconds = models.FloatField(null=True, blank=True, help_text="Queued to ready (smoke-tested).")
    steps = models.JSONField(default=list, blank=True, help_text="The start's timeline steps: [[step, seconds], ...].")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)
    ended = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-number"]
        constraints = [models.UniqueConstraint(fields=["deployment", "number"], name="version_unique_per_deployment")]

    def __str__(self):
        return f"{self.deployment.name} v{self.number}"


class DeploymentEnergy(models.Model):
    """What a deployment's GPUs drew in one hour while it was up, from their energy counters as the node agent read
    them beside the engine's /metrics (deployments/node/energyhours.py): the joules, the seconds they cover, the
    joules and seconds while the engine had nothing running or waiting (its idle draw), and the output tokens the
    engine counted. deployments/energy.py turns them into joules per token, gross and net of idle, and shares them
    out to the gateway's keys."""

    hour = models.DateTimeField(help_text="The hour's start, UTC.")
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="energy_hours")
    joules = models.FloatField(default=0.0)
    seconds = models.FloatField(default=0.0, help_text="The time the joules cover (between the agent's readings).")
    idle_joules = models.FloatField(default=0.0)
    idle_seconds = models.FloatField(default=0.0, help_text="Of `seconds`, those with nothing running or waiting.")
    output_tokens = models.BigIntegerField(default=0, help_text="The engine's own count (generation tokens).")

    class Meta:
        ordering = ["hour"]
        constraints = [models.UniqueConstraint(fields=["hour", "deployment"], name="energy_hour_unique_per_deployment")]

    def __str__(self):
        return f"{self.deployment_id} {self.hour:%Y-%m-%d %H}:00"
