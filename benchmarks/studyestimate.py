"""How long a study will take, from what its node measured: the deployment's redeploys (past trials,
else its last plan from queued to smoke-tested) and its benchmark runs (the same workload's wall time,
else a model of each level from the nearest level measured, else the smoke test's decode rate). Only
what was never measured is guessed, and the estimate says so ("guess", and the basis begins "a guess")."""
import math
import statistics
from types import SimpleNamespace

from benchmarks.models import BenchmarkPoint, BenchmarkRun, StudyTrial
from benchmarks.runner import arrivals, spec_default
from deployments.models import Deployment, DeploymentEvent

DEFAULT_READY_S = 120.0  # a deployment never loaded: a guess
GUESSED = "a guess"  # the words a basis ends with where nothing was measured
STOP_S = 3.0  # stopping the running engine before a redeploy, when the last plan stopped none
RUN_OVERHEAD_S = 4.0  # a run's own start and end (child process, prompt lengths, workers), when none was timed
TRIAL_OVERHEAD_S = 2.0  # the study driver's steps around a trial (it looks twice a second), when none was timed
GUESS_TOK_S = 20.0  # one stream's decode rate when nothing was measured
GUESS_TTFT_S = 0.2
# How much longer a request takes at concurrency c than at c0, when only c0 was measured: (c / c0) ** this.
# Batching makes it far less than linear (the CPU engine here: 1.8x from 1 to 16 streams; GPUs batch better).
CONCURRENCY_EXPONENT = 0.2
WORKLOAD_KEYS = ("levels", "rates", "rate_duration_s", "max_tokens", "input_tokens", "requests_per_user", "min_requests",
                 "warmup_per_user", "prompt_source", "endpoint")


def redeploy_seconds(d: Deployment) -> tuple[float, str]:
    """(seconds from a redeploy's request to ready and smoke-tested, where the figure comes from)."""
    past = list(StudyTrial.objects.filter(study__deployment=d, ready_s__isnull=False)
                .order_by("-finished").values_list("ready_s", flat=True)[:10])
    if past:
        return round(statistics.median(past), 1), f"its last {len(past)} redeploys in studies"
    # The last plan's end: its smoke test, or its load while the smoke test has not answered yet (a study made
    # right after ready must not fall back to the guess: that made a 51 s study read 22 minutes).
    last = DeploymentEvent.objects.filter(deployment=d, step__in=("smoke_test", "load"), ended__isnull=False) \
        .order_by("-started", "-pk").first()
    queued = last and DeploymentEvent.objects.filter(deployment=d, step="queued", started__lte=last.started).order_by("-started").first()
    if queued:
        steps = DeploymentEvent.objects.filter(deployment=d, started__gte=queued.started, started__lte=last.started)
        stopped = steps.filter(step__in=("stop", "stop_others")).exists()
        # A redeploy finds the copy in place: the last plan's download (its "model" step) is not repeated.
        fetched = sum((e.ended - e.started).total_seconds() for e in steps.filter(step="model", ended__isnull=False))
        wall = (last.ended - queued.started).total_seconds() - fetched
        return round(wall + (0 if stopped else STOP_S), 1), "its last load"
    return DEFAULT_READY_S, f"no load of it recorded yet: {GUESSED}"


def _level_counts(workload: dict, c: int) -> int:
    """Requests sent at level c, warm-up included (LoadSpec.num_requests + num_warmup)."""
    measured = max(int(workload.get("min_requests", 32)), int(workload.get("requests_per_user", 4)) * c)
    return measured + max(0, int(workload.get("warmup_per_user", 1)) * c)


def _request_seconds(point: BenchmarkPoint, max_tokens: int, c: int) -> float:
    """One request's time at level c with max_tokens, from a level measured at point.concurrency."""
    ttft = (point.ttft_ms or {}).get("median", 0.0) / 1000
    tpot = (point.tpot_ms or {}).get("median")
    if tpot:
        seconds = ttft + (max_tokens - 1) * tpot / 1000
    else:  # no decode seen (one read per request): the whole request, scaled by its length
        asked = max(1, point.output_tokens / max(1, point.num_requests - point.failed_requests))
        seconds = (point.e2e_ms or {}).get("median", 0.0) / 1000 * max_tokens / asked
    return seconds * (c / point.concurrency) ** CONCURRENCY_EXPONENT


def _rate_counts(workload: dict, rate: float) -> tuple[int, int]:
    """(measured, warm-up) requests of a rate level, as the runner counts them (runner/arrivals.py)."""
    spec = SimpleNamespace(**{k: workload.get(k, spec_default(k)) for k in ("min_requests", "rate_duration_s",
                                                                           "warmup_per_user")})
    spec.min_requests, spec.warmup_per_user = int(spec.min_requests), int(spec.warmup_per_user)
    measured = arrivals.rate_requests(spec, float(rate))
    return measured, arrivals.rate_warmup(spec, float(rate), measured)


def _modelled(points: list[BenchmarkPoint], workload: dict) -> float:
    """Seconds the workload's levels take, each concurrency from the measured level nearest to it (log scale).
    A rate level's schedule sets its time, not the engine: its requests (warm-up included, sent at the level's
    rate too) ÷ the rate, plus one request's time for the last to finish (the single stream's, the nearest to
    a lightly loaded engine). A ramp or a multi-turn workload's think times make it longer: not modelled."""
    total = 0.0
    max_tokens = int(workload["max_tokens"])
    for c in workload.get("levels") or []:
        near = min(points, key=lambda p: abs(math.log(p.concurrency / c)))
        total += _level_counts(workload, c) / c * _request_seconds(near, max_tokens, c)
    for rate in workload.get("rates") or []:
        measured, warmup = _rate_counts(workload, rate)
        lowest = min(points, key=lambda p: p.concurrency)
        total += (measured + warmup) / float(rate) + _request_seconds(lowest, max_tokens, lowest.concurrency)
    return total


def _workload_keys(params: dict) -> dict:
    """What makes two benchmarks take the same time; no rates and "rates": [] alike."""
    return {k: params.get(k) for k in WORKLOAD_KEYS} | {"rates": params.get("rates") or None}


def bench_seconds(d: Deployment, workload: dict) -> tuple[float, str]:
    """(seconds one trial's benchmark run takes, where the figure comes from)."""
    runs = list(BenchmarkRun.objects.filter(deployment=d, status=BenchmarkRun.Status.DONE)
                .exclude(started=None).exclude(finished=None).order_by("-finished")[:20])
    wanted = _workload_keys(workload)
    for run in runs:
        if _workload_keys(run.params) == wanted:
            return round((run.finished - run.started).total_seconds(), 1), "its last run of this workload"
    for run in runs:
        points = [p for p in run.points.all() if p.kind == p.Kind.CONCURRENCY]
        if points:
            own = {**run.params, "levels": [p.concurrency for p in points]}
            overhead = max(0.0, (run.finished - run.started).total_seconds() - _modelled(points, own))
            return round(_modelled(points, workload) + overhead, 1), f"levels measured in run {run.pk}"
    smoke = d.smoke or {}
    tok_s = GUESS_TOK_S
    if smoke.get("latency_s") and smoke.get("completion_tokens"):
        tok_s = smoke["completion_tokens"] / smoke["latency_s"]
    guess = BenchmarkPoint(concurrency=1, ttft_ms={"median": GUESS_TTFT_S * 1000}, tpot_ms={"median": 1000 / tok_s})
    basis = "its smoke test's decode rate" if tok_s != GUESS_TOK_S else f"no run or smoke test of it yet: {GUESSED}"
    return round(_modelled([guess], workload) + RUN_OVERHEAD_S, 1), basis


def trial_overhead_seconds(d: Deployment) -> float:
    past = [s for s in StudyTrial.objects.filter(study__deployment=d, overhead_s__isnull=False)
            .order_by("-finished").values_list("overhead_s", flat=True)[:10]]
    return statistics.median(past) if past else TRIAL_OVERHEAD_S


def study_estimate(d: Deployment, trials: int, workload: dict) -> dict:
    """{"ready_s", "benchmark_s", "overhead_s", "trial_s", "estimate_s", "basis", "guess"}: every trial redeploys
    and runs the workload, then the closing redeploy puts the baseline back. "guess" is true when a part was never
    measured on the node (its basis then starts "a guess:", so every place that shows the basis says so)."""
    ready_s, ready_basis = redeploy_seconds(d)
    done = (StudyTrial.objects.filter(study__deployment=d, status=StudyTrial.Status.DONE).exclude(started=None)
            .exclude(finished=None).select_related("study").order_by("-finished")[:50])
    walls = [(t.finished - t.started).total_seconds() for t in done if t.study.workload == workload][:10]
    if walls:  # trials of this very workload ran here: their wall time says it all
        trial_s = statistics.median(walls)
        return _said({"ready_s": ready_s, "benchmark_s": None, "overhead_s": None, "trial_s": round(trial_s, 1),
                      "estimate_s": round(trials * trial_s + ready_s, 1),
                      "basis": f"its last {len(walls)} trials of this workload; redeploy: {ready_basis}"})
    bench_s, bench_basis = bench_seconds(d, workload)
    overhead_s = round(trial_overhead_seconds(d), 1)
    total = trials * (ready_s + bench_s + overhead_s) + ready_s
    return _said({"ready_s": ready_s, "benchmark_s": bench_s, "overhead_s": overhead_s,
                  "trial_s": round(ready_s + bench_s + overhead_s, 1), "estimate_s": round(total, 1),
                  "basis": f"redeploy: {ready_basis}; benchmark: {bench_basis}"})


def _said(estimate: dict) -> dict:
    """The estimate marked a guess, up front, when any part of it was never measured on the node."""
    guess = GUESSED in estimate["basis"]
    return {**estimate, "guess": guess, "basis": f"{GUESSED}: {estimate['basis']}" if guess else estimate["basis"]}
