from rest_framework import serializers

from benchmarks import runcommand, runner, selectors, workloads
from benchmarks.forms import MAX_BURSTINESS, MAX_LEVEL, MAX_RATE, ramp_problem, rates_problem
from benchmarks.models import BenchmarkPoint, BenchmarkRun, Workload
from benchmarks.runner import capacity as capacity_search, slo as slo_mod
from deployments.models import Deployment
from plumbing.errors import ServiceError
from plumbing.params import DB_INT_MAX

default = runner.spec_default


class BenchmarkPointSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkPoint
        exclude = ["run", "samples"]  # per-request figures: for studies' statistics, not for reading


class BenchmarkRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkRun
        fields = ["id", "name", "deployment", "base_url", "served_model", "params", "status", "error", "environment",
                  "warnings", "single_stream_tok_s", "idle_watts", "saturation", "capacity", "created", "started", "finished"]

    saturation = serializers.SerializerMethodField(help_text=(
        'Where more concurrency stopped buying throughput, and why: {"level": 16 or null, "reason", "text"}; '
        "null before two levels are measured."))

    def get_saturation(self, run) -> dict | None:
        return selectors.run_saturation(run)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        # Uploaded prompts and a workload's file data can be large: the workload by name (GET /api/workloads/{id}/).
        data["params"] = {k: v for k, v in data["params"].items() if k not in ("prompts", "workload")}
        return data


class BenchmarkRunDetailSerializer(BenchmarkRunSerializer):
    """One run, with its commands (the list leaves them out: they read the deployment's node and workload)."""

    class Meta(BenchmarkRunSerializer.Meta):
        fields = [*BenchmarkRunSerializer.Meta.fields, "commands", "over_repeats"]

    commands = serializers.SerializerMethodField(help_text=(
        'The run as commands: {"panelctl": the `panelctl bench` line that sends the same requests again, '
        '"panelctl_note", "vllm": `vllm bench serve` lines of the same shape, one per level (none for prompts it '
        'has no dataset for), "vllm_note"}.'))

    def get_commands(self, run) -> dict:
        return runcommand.commands(run)


class CapacitySerializer(serializers.Serializer):
    """A capacity search: the highest rate in [low, high] req/s meeting the SLOs, to within `width` (bisection)."""

    low = serializers.FloatField(min_value=0, max_value=MAX_RATE, help_text="Requests/s taken to meet the SLOs.")
    high = serializers.FloatField(min_value=0, max_value=MAX_RATE, help_text="Requests/s taken to miss them.")
    width = serializers.FloatField(min_value=0, required=False, default=0.0, help_text=(
        "Stop once the interval is this narrow (req/s); 0: (high - low) / 64."))
    repeats = serializers.IntegerField(min_value=1, max_value=capacity_search.MAX_REPEATS, default=1, help_text=(
        "Times each rate runs (each with its own arrivals); it passes when every repeat meets every SLO."))


class RunRequestSerializer(serializers.Serializer):
    """A sweep against a deployment (by id) or a URL; levels default to 1, 2, 4, … up to what the deployment
    runs at once (its --max-num-seqs; 64 on a CPU node), 1024 for a URL."""

    deployment = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.all(), required=False, allow_null=True)
    base_url = serializers.URLField(required=False, allow_blank=True, max_length=500)
    served_model = serializers.RegexField(r"^[\w./:@+-]*$", required=False, allow_blank=True, max_length=200, default="",
                                          error_messages={"invalid": "A model name: letters, digits and . / : @ + - _"})
    name = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    levels = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=4096), min_length=1, max_length=20,
                                   required=False)
    endpoint = serializers.ChoiceField(choices=[runner.CHAT, runner.COMPLETIONS], default=default("endpoint"))
    prompt_source = serializers.ChoiceField(choices=["builtin", "random", "jsonl"], default=default("prompt_source"))
    prompts_jsonl = serializers.CharField(required=False, allow_blank=True, max_length=20 * 2**20)
    input_tokens = serializers.IntegerField(min_value=1, max_value=200_000, default=default("input_tokens"))
    max_tokens = serializers.IntegerField(min_value=1, max_value=200_000, default=default("max_tokens"))
    ignore_eos = serializers.BooleanField(default=default("ignore_eos"))
    temperature = serializers.FloatField(min_value=0, max_value=2, default=default("temperature"))
    requests_per_user = serializers.IntegerField(min_value=1, max_value=1000, default=default("requests_per_user"))
    min_requests = serializers.IntegerField(min_value=1, max_value=100_000, default=default("min_requests"))
    warmup_per_user = serializers.IntegerField(min_value=0, max_value=100, default=default("warmup_per_user"))
    rates = serializers.ListField(child=serializers.FloatField(), max_length=20, required=False, help_text=(
        "Open-loop levels in requests/s (each above 0, at most 10,000), run after the concurrency levels; "
        "with rates and no levels, only rate levels run."))
    arrival = serializers.ChoiceField(choices=list(runner.ARRIVALS), required=False, help_text=(
        "poisson, or gamma with the burstiness as its shape (default: gamma when burstiness is not 1)."))
    burstiness = serializers.FloatField(min_value=0.01, max_value=MAX_BURSTINESS, default=default("burstiness"))
    max_concurrency = serializers.IntegerField(min_value=0, max_value=MAX_LEVEL, default=default("max_concurrency"),
                                               help_text="A rate level's cap on requests in flight; 0: none.")
    ramp = serializers.ChoiceField(choices=list(runner.RAMPS), default=default("ramp"), allow_blank=True)
    ramp_from = serializers.FloatField(default=default("ramp_from"), help_text="Requests/s at the ramp's start.")
    rate_duration_s = serializers.FloatField(min_value=1, max_value=3600, default=default("rate_duration_s"), help_text=(
        "A rate level sends max(min_requests, rate × this) requests."))
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, default=default("seed"), help_text=(
        "Seeds the prompts and the arrivals: the same seed sends the same schedule."))
    workload = serializers.CharField(required=False, allow_blank=True, max_length=100, help_text=(
        "A named workload (GET /api/workloads/), by id or name: its prompts, lengths (input_tokens and max_tokens "
        "are its own) and, for a trace given neither levels nor rates, its own rate (1x)."))
    slos = serializers.JSONField(required=False, help_text=(
        'SLOs each level is scored against: "ttft:p99:2s, itl:p95:50ms" or [{"metric": "ttft", "percentile": 99, '
        '"max_ms": 2000}, ...] (metrics ttft, itl, e2e); each level then reports its goodput and attainment.'))
    capacity = CapacitySerializer(required=False, help_text=(
        "Search for the highest request rate that meets the SLOs (rate levels chosen by bisection); the run's "
        "capacity then says \"serves X req/s at p99 TTFT <= 2 s\"."))
    request_timeout_s = serializers.FloatField(allow_null=True, default=default("request_timeout_s"), help_text=(
        "Seconds each request may take, at most a day; null: each request's own, from its max_tokens at a floor of "
        "0.5 tok/s plus time for its first token (at least 600 s), so long answers at high concurrency finish."))
    repeats = serializers.IntegerField(min_value=1, max_value=runner.MAX_REPEATS, default=default("repeats"), help_text=(
        "Times each level is measured, one after another, each with prompts (and arrivals) of its own seed; the run "
        "then gives each level's figures as a median with a 95 % interval (from 3 repeats): GET /api/runs/{id}/."))
    stop_when_saturated = serializers.BooleanField(default=default("stop_when_saturated"), help_text=(
        "End the sweep once a level shows the engine saturated (throughput flat while latency or the waiting "
        "queue climbs); false measures every level."))

    def validate_request_timeout_s(self, value):
        if problem := runner.timeout_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate(self, data):
        if bool(data.get("deployment")) == bool(data.get("base_url")):
            raise serializers.ValidationError({"deployment": ["Give a deployment or a base_url (not both)."]})
        if data["prompt_source"] == "jsonl":
            try:
                data["prompts"] = runner.load_jsonl(data.get("prompts_jsonl") or "", data["endpoint"])
            except runner.PromptError as exc:
                raise serializers.ValidationError({"prompts_jsonl": [str(exc)]}) from exc
        data.pop("prompts_jsonl", None)
        rates = data.get("rates") or []
        if problem := rates_problem(rates):
            raise serializers.ValidationError({"rates": [problem]})
        if problem := ramp_problem(data["ramp"], data["ramp_from"]):
            raise serializers.ValidationError({"ramp_from": [problem]})
        data.setdefault("arrival", "poisson" if data["burstiness"] == 1 else "gamma")
        workload = _workload(data.pop("workload", ""))
        trace = workload is not None and workload.kind == Workload.Kind.TRACE
        if not data.get("levels"):  # a trace given neither replays at its own rate (workload_params)
            data["levels"] = [] if rates or trace or data.get("capacity") else selectors.default_levels(data.get("deployment"))
        data = _slo_fields(data)
        if workload is not None:
            try:
                data = workloads.workload_params(workload, data)
            except ServiceError as exc:
                raise serializers.ValidationError({exc.field or "workload": [exc.message]}) from exc
        return data


def _slo_fields(data: dict) -> dict:
    """SLOs from text or a list, checked; a capacity search's settings checked against them."""
    raw = data.get("slos")
    try:
        data["slos"] = slo_mod.parse(raw) if isinstance(raw, str) else slo_mod.validate(raw or [])
    except runner.RunnerError as exc:
        raise serializers.ValidationError({"slos": [exc.message]}) from exc
    if data.get("capacity"):
        if not data["slos"]:
            raise serializers.ValidationError({"slos": ["A capacity search needs SLOs to meet, e.g. ttft:p99:2s."]})
        try:
            data["capacity"] = capacity_search.check(data["capacity"])
        except runner.RunnerError as exc:
            raise serializers.ValidationError({"capacity": [exc.message]}) from exc
    return data


def _workload(ref: str) -> Workload | None:
    """The named workload a request asks for, by id or name (None for none)."""
    ref = (ref or "").strip()
    if not ref:
        return None
    by_id = ref.isdigit() and int(ref) <= DB_INT_MAX  # a larger number is no id (SQLite would raise on it)
    found = Workload.objects.filter(pk=int(ref)).first() if by_id else Workload.objects.filter(name=ref).first()
    if found is None:
        raise serializers.ValidationError({"workload": [f"No workload {ref!r}; GET /api/workloads/ lists them."]})
    return found
