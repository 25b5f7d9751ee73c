"""Benchmark runs and their results, one point per concurrency level."""
from django.conf import settings
from django.db import models

from django.utils import timezone

from controlpanel.states import Transitions
from deployments.models import Deployment


class BenchmarkRun(Transitions, models.Model):
    """A sweep over concurrency levels against a deployment or any OpenAI-compatible URL."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    ACTIVE = frozenset({Status.QUEUED, Status.RUNNING})
    TERMINAL = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED})
    TRANSITIONS = {
        Status.QUEUED: {Status.RUNNING, Status.CANCELLED, Status.FAILED},
        Status.RUNNING: {Status.DONE, Status.FAILED, Status.CANCELLED},
    }

    name = models.CharField(max_length=200, blank=True)
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="benchmark_runs")
    base_url = models.URLField(max_length=500, blank=True, help_text="An OpenAI-compatible server, when not a deployment.")
    served_model = models.CharField(max_length=200, blank=True)
    params = models.JSONField(default=dict, blank=True, help_text="Concurrency levels, prompts, max tokens, ...")
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED)
    error = models.TextField(blank=True)
    environment = models.JSONField(default=dict, blank=True, help_text="Engine version, flags, env vars, GPUs.")
    warnings = models.JSONField(default=list, blank=True)
    ticks = models.JSONField(default=list, blank=True, help_text="[[seconds since start, concurrency, tok/s], ...]")
    single_stream_tok_s = models.FloatField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self):
        return self.name or f"run {self.pk}"

    @property
    def target(self) -> str:
        return str(self.deployment) if self.deployment_id else self.base_url

    def entered(self, status) -> None:
        if status == self.Status.RUNNING:
            self.started = timezone.now()
        elif status in self.TERMINAL:
            self.finished = timezone.now()


class BenchmarkPoint(models.Model):
    """The results of one concurrency level of a run; every metric is a number."""

    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="points")
    concurrency = models.PositiveIntegerField()
    num_requests = models.PositiveIntegerField(default=0)
    failed_requests = models.PositiveIntegerField(default=0)
    duration_s = models.FloatField(default=0.0)
    request_throughput = models.FloatField(default=0.0)
    output_throughput = models.FloatField(default=0.0)
    total_token_throughput = models.FloatField(default=0.0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    reasoning_tokens = models.BigIntegerField(default=0)
    content_tokens = models.BigIntegerField(default=0)
    tok_s_per_user = models.FloatField(default=0.0)
    peak_tok_s = models.FloatField(default=0.0)
    reasoning_split = models.CharField(max_length=16, blank=True, help_text="How reasoning tokens were counted.")
    tokens_per_chunk = models.CharField(max_length=16, blank=True, help_text="usage (exact) or estimated.")
    errors = models.JSONField(default=list, blank=True)
    # Latency distributions in milliseconds: {"mean", "median", "std", "p90", "p95", "p99"}.
    ttft_ms = models.JSONField(default=dict)
    ttfc_ms = models.JSONField(default=dict, help_text="Time to first content token (not reasoning).")
    ttft_vllm_bench_ms = models.JSONField(default=dict, blank=True, help_text=(
        "TTFT as vllm bench serve counts it: to the first chunk with a choice, role-only included."))
    tpot_ms = models.JSONField(default=dict)
    itl_ms = models.JSONField(default=dict)
    itl_per_token_ms = models.JSONField(default=dict)
    e2e_ms = models.JSONField(default=dict)
    server_metrics = models.JSONField(default=dict, help_text="/metrics gauges scraped during the level.")
    prompt_tokens_requested = models.PositiveIntegerField(null=True, blank=True, help_text=(
        "Prompt length asked for (random prompts), in the served model's tokens."))
    prompt_tokens_mean = models.FloatField(default=0.0, help_text="Mean prompt tokens the server counted (usage).")
    prompt_tokens_counted_by = models.CharField(max_length=64, blank=True, help_text=(
        "How random prompts were sized: the server's /tokenize, the tokenizer files, or words."))
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "concurrency"]
        constraints = [models.UniqueConstraint(fields=["run", "concurrency"], name="point_unique_level")]

    def __str__(self):
        return f"{self.run} c={self.concurrency}"
