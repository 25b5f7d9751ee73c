"""Benchmark runs and their results, one point per concurrency level."""
from django.conf import settings
from django.db import models

from django.utils import timezone

from deployments.models import Deployment
from plumbing.states import Transitions


class Job(Transitions, models.Model):
    """Work a user asks for that starts and ends (a run, a study): who asked, and when it was made, started and
    ended (stamped as its status moves); newest first."""

    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True
        ordering = ["-created"]

    def entered(self, status) -> None:
        if status == self.Status.RUNNING and not self.started:  # a study resumed after a pause keeps its start
            self.started = timezone.now()
        elif status in self.TERMINAL:
            self.finished = timezone.now()


class BenchmarkRun(Job):
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
    idle_watts = models.FloatField(null=True, blank=True, help_text=(
        "What the deployment's GPUs drew with the engine loaded and serving nothing, measured just before the first "
        "level (W, all its GPUs on this node); empty without energy counters or when the engine was not idle."))
    capacity = models.JSONField(default=dict, blank=True, help_text=(
        "A capacity search's answer: the highest rate measured to meet the SLOs, the interval, each round and the "
        "sentence (benchmarks/runner/capacity.py); empty for other runs."))
    over_repeats = models.JSONField(default=list, blank=True, help_text=(
        "With params.repeats above 1, each level's figures over its repeats (median, and the 95 % interval of the "
        "mean from 3 repeats: benchmarks/runrepeats.py), worked out once as the run ends; empty otherwise."))
    cancel_requested = models.BooleanField(default=False)

    def __str__(self):
        return self.name or f"run {self.pk}"

    @property
    def target(self) -> str:
        return str(self.deployment) if self.deployment_id else self.base_url


class BenchmarkPoint(models.Model):
    """The results of one level of a run (a concurrency, or a request rate); every metric is a number."""

    class Kind(models.TextChoices):
        CONCURRENCY = "concurrency", "Concurrency"
        RATE = "rate", "Request rate"

    run = models.ForeignKey(BenchmarkRun, on_delete=models.CASCADE, related_name="points")
    kind = models.CharField(max_length=12, choices=Kind.choices, default=Kind.CONCURRENCY)
    concurrency = models.PositiveIntegerField(help_text="Requests in flight at once; a rate level's cap (0: none).")
    rate = models.FloatField(default=0.0, help_text="A rate level's requests/s asked (the end of a ramp); 0 otherwise.")
    achieved_rate = models.FloatField(default=0.0, help_text="Requests/s sent: (n - 1) ÷ first to last send.")
    lag_ms = models.JSONField(default=dict, blank=True, help_text=(
        "Schedule lag of a rate level, sent - due, in ms: {p50, p99, max, mean}; slot waits included."))
    slot_wait_ms = models.JSONField(default=dict, blank=True, help_text=(
        "Waits for a slot under the rate level's max_concurrency, in ms: {p50, p99, max, mean, count}."))
    num_requests = models.PositiveIntegerField(default=0)
    failed_requests = models.PositiveIntegerField(default=0)
    warmup_requests = models.PositiveIntegerField(default=0, help_text=(
        "Warm-up requests the level sent before the measured ones (in none of its figures)."))
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
    errors = models.JSONField(default=list, blank=True, help_text=(
        "The distinct errors of failed requests, timeouts apart."))
    timeouts = models.PositiveIntegerField(default=0, help_text=(
        "Measured requests that ran past their timeout (among failed_requests; the run's request_timeout_s, else "
        "each request's own from its max_tokens)."))
    rejected = models.PositiveIntegerField(default=0, help_text=(
        "Of failed_requests, those the server refused for load (429, or vLLM's admission 503 once "
        "--max-num-queued-reqs or --max-num-queued-tokens is reached): not errors."))
    # Latency distributions in milliseconds: {"mean", "median", "std", "p90", "p95", "p99"}.
    ttft_ms = models.JSONField(default=dict)
    ttfc_ms = models.JSONField(default=dict, help_text="Time to first content token (not reasoning).")
    ttft_vllm_bench_ms = models.JSONField(default=dict, blank=True, help_text=(
        "TTFT as vllm bench serve counts it: to the first chunk with a choice, role-only included."))
    tpot_ms = models.JSONField(default=dict)
    itl_ms = models.JSONField(default=dict)
    itl_per_token_ms = models.JSONField(default=dict)
    e2e_ms = models.JSONField(default=dict)
    server_metrics = models.JSONField(default=dict, help_text=(
        "/metrics gauges scraped during the level; prefix_cache: the engine's own prefix-cache queries, hits "
        "(prompt tokens) and hit rate over the level, warm-up included."))
    prefix_reuse = models.JSONField(default=dict, blank=True, help_text=(
        "What a prefix cache could have served of the level's measured prompts, from the workload's structure: "
        "{prompt_tokens, reusable_tokens, share}; empty for prompts without one."))
    energy_j = models.FloatField(null=True, blank=True, help_text=(
        "Joules the deployment's GPUs used over the level's measured window (NVML's energy counters); "
        "empty on a node without them."))
    watts_per_gpu = models.FloatField(null=True, blank=True, help_text="Average power per GPU over the level (W).")
    energy_net_j = models.FloatField(null=True, blank=True, help_text=(
        "energy_j less the GPUs' idle draw over the level (the run's idle_watts x its duration): what serving cost."))
    prompt_tokens_requested = models.PositiveIntegerField(null=True, blank=True, help_text=(
        "Prompt length asked for (random prompts), in the served model's tokens."))
    prompt_tokens_mean = models.FloatField(default=0.0, help_text="Mean prompt tokens the server counted (usage).")
    prompt_tokens_counted_by = models.CharField(max_length=64, blank=True, help_text=(
        "How random prompts were sized: the server's /tokenize, the tokenizer files, or words."))
    samples = models.JSONField(default=dict, blank=True, help_text=(
        "Per-request figures behind the distributions (tok_s, ttft_ms, tpot_ms), for a study's bootstrap."))
    goodput = models.FloatField(null=True, blank=True, help_text="Requests/s meeting every SLO of the run; empty without SLOs.")
    slo = models.JSONField(default=dict, blank=True, help_text=(
        "The level against the run's SLOs: {good, goodput, attainment_pct, met, each: [{metric, percentile, max_ms, "
        "met_pct, holds, value_ms}]}."))
    repeat = models.PositiveSmallIntegerField(default=0, help_text="A capacity search's repeat of the same rate.")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "kind", "rate", "concurrency", "repeat"]
        constraints = [models.UniqueConstraint(fields=["run", "kind", "rate", "concurrency", "repeat"], name="point_unique_level")]

    def __str__(self):
        return f"{self.run} {self.rate:g} req/s" if self.kind == self.Kind.RATE else f"{self.run} c={self.concurrency}"


class Study(Job):
    """A tuning study: a deployment's baseline and variants, each redeployed and benchmarked in repeats."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        PAUSED = "paused", "Paused"
        FINISHING = "finishing", "Restoring the deployment"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    # Advanced by the node agent's study driver one step at a time (benchmarks.studies.study_step).
    DRIVEN = frozenset({Status.QUEUED, Status.RUNNING, Status.FINISHING})
    ACTIVE = DRIVEN | {Status.PAUSED}
    TERMINAL = frozenset({Status.DONE, Status.FAILED, Status.CANCELLED})
    TRANSITIONS = {
        Status.QUEUED: {Status.RUNNING, Status.CANCELLED, Status.FAILED},
        Status.RUNNING: {Status.PAUSED, Status.FINISHING, Status.FAILED},
        Status.PAUSED: {Status.RUNNING, Status.FINISHING, Status.FAILED},
        Status.FINISHING: {Status.DONE, Status.CANCELLED, Status.FAILED},
    }

    name = models.CharField(max_length=200, blank=True)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="studies")
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED)
    error = models.TextField(blank=True)
    repeats = models.PositiveSmallIntegerField(default=3)
    max_repeats = models.PositiveSmallIntegerField(default=0, help_text=(
        "Adaptive when above `repeats`: judged after `repeats` and after every round more, and ended once every "
        "variant is decided on the rule's figure, or after this many; 0: `repeats`, no more."))
    order = models.CharField(max_length=16, default="interleaved", help_text="interleaved (A B C A B C), mirrored (A B C C B A) or random_blocks.")
    workload = models.JSONField(default=dict, help_text="The benchmark params every trial runs (levels, prompts, lengths).")
    base_engine_args = models.JSONField(default=dict, help_text="The deployment's flags when the study was made.")
    base_env = models.JSONField(default=dict, help_text="The deployment's environment when the study was made.")
    rule = models.JSONField(default=dict, help_text='How the winner is chosen: {"kind": "throughput", "level": 16}, ...')
    finish_with = models.CharField(max_length=10, default="baseline", help_text="What runs at the end: baseline or winner.")
    estimate_s = models.FloatField(null=True, blank=True, help_text="Predicted duration when it was made.")
    estimate_basis = models.CharField(max_length=300, blank=True, help_text="What the estimate came from; it starts "
                                      "'a guess' where nothing of the deployment was measured yet.")
    cancel_requested = models.BooleanField(default=False)
    pause_requested = models.BooleanField(default=False)
    finish_trial = models.JSONField(default=dict, blank=True, help_text="The closing redeploy: {engine_args, env, sent, agent_pid}.")
    results = models.JSONField(default=dict, blank=True, help_text="Estimates, comparisons and verdicts (benchmarks.studies).")

    class Meta(Job.Meta):
        verbose_name_plural = "studies"

    def __str__(self):
        return self.name or f"study {self.pk}"

    @property
    def looks(self) -> int:
        """How many times the study may be judged: after `repeats`, and after each round more up to `max_repeats`."""
        return max(self.max_repeats - self.repeats, 0) + 1


class StudyVariant(models.Model):
    """One setting under test: changes to the baseline's flags and environment (the baseline has none)."""

    study = models.ForeignKey(Study, on_delete=models.CASCADE, related_name="variants")
    position = models.PositiveSmallIntegerField()
    name = models.CharField(max_length=120)
    is_baseline = models.BooleanField(default=False)
    engine_args = models.JSONField(default=dict, blank=True, help_text="Flags set (a false value removes the flag).")
    env = models.JSONField(default=dict, blank=True, help_text="Environment variables set (an empty value removes one).")
    failed = models.TextField(blank=True, help_text="Why it could not start or crashed; its later trials are skipped.")

    class Meta:
        ordering = ["study", "position"]
        constraints = [models.UniqueConstraint(fields=["study", "position"], name="variant_unique_position")]

    def __str__(self):
        return self.name


class StudyTrial(Transitions, models.Model):
    """One repeat of one variant: a redeploy with its settings, then the workload as a benchmark run."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DEPLOYING = "deploying", "Deploying"
        BENCHMARKING = "benchmarking", "Benchmarking"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"
        SKIPPED = "skipped", "Skipped"

    OPEN = frozenset({Status.PENDING, Status.DEPLOYING, Status.BENCHMARKING})
    TERMINAL = frozenset({Status.DONE, Status.FAILED, Status.SKIPPED})
    # An open trial may fail; a redeploy or a run the agent restart cut short runs the trial again (PENDING);
    # a pending one is skipped when its variant failed earlier or the study is cancelled. Ended trials stay.
    TRANSITIONS = {
        Status.PENDING: {Status.DEPLOYING, Status.SKIPPED, Status.FAILED},
        Status.DEPLOYING: {Status.BENCHMARKING, Status.PENDING, Status.FAILED},
        Status.BENCHMARKING: {Status.DONE, Status.PENDING, Status.FAILED},
    }
    study = models.ForeignKey(Study, on_delete=models.CASCADE, related_name="trials")
    variant = models.ForeignKey(StudyVariant, on_delete=models.CASCADE, related_name="trials")
    position = models.PositiveIntegerField(help_text="Its place in the study's order.")
    repeat = models.PositiveSmallIntegerField()
    status = models.CharField(max_length=14, choices=Status.choices, default=Status.PENDING)
    run = models.ForeignKey(BenchmarkRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="trials")
    attempts = models.PositiveSmallIntegerField(default=0)
    agent_pid = models.IntegerField(null=True, blank=True, help_text="The node agent when the step was sent.")
    error = models.TextField(blank=True)
    startup = models.JSONField(default=dict, blank=True, help_text="Seconds per start-up phase of this trial's load.")
    ready_s = models.FloatField(null=True, blank=True, help_text="Redeploy sent -> ready and smoke-tested.")
    overhead_s = models.FloatField(null=True, blank=True, help_text="The panel's own time beyond start-up and benchmark.")
    started = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["study", "position"]
        constraints = [models.UniqueConstraint(fields=["study", "position"], name="trial_unique_position")]

    def __str__(self):
        return f"{self.variant} #{self.repeat}"


class Workload(models.Model):
    """A named, reusable workload (shared prefixes, multi-turn conversations, ShareGPT, a Mooncake trace)
    that runs take their prompts from; `spec` is the runner's description, `preview` its lengths."""

    class Kind(models.TextChoices):
        PREFIX = "prefix", "Shared prefixes"
        MULTITURN = "multiturn", "Multi-turn conversations"
        SHAREGPT = "sharegpt", "ShareGPT conversations"
        TRACE = "trace", "Mooncake trace"

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=12, choices=Kind.choices)
    spec = models.JSONField(help_text="The runner's workload (benchmarks/runner/workloads.py), file data included.")
    input_tokens = models.PositiveIntegerField(default=128, help_text="Shared prefixes: each suffix; multi-turn: each user message.")
    max_tokens = models.PositiveIntegerField(default=128, help_text="Shared prefixes and multi-turn: each answer (and "
                                             "each made-up reply resent in the history).")
    preview = models.JSONField(default=dict, blank=True, help_text="Prompt and output lengths, reuse, a trace's timing.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name
