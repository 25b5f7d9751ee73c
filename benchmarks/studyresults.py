"""Reads of tuning studies: per-variant estimates, comparisons with the baseline and verdicts (with
benchmarks.studystats), the winner by the study's rule, the Pareto front, the live matrix, estimates."""
import statistics

from django.utils import timezone

from benchmarks import selectors, studylevels, studystats
from benchmarks.models import BenchmarkPoint, BenchmarkRun, Study, StudyTrial, StudyVariant
from deployments.models import DeploymentEvent
from plumbing import csvsafe

def _median_rate(point) -> float | None:
    rates = (point.samples or {}).get("tok_s")
    return statistics.median(rates) if rates else point.tok_s_per_user


# metric -> (label, kind of bootstrap replicate, higher is better, the point's value, its per-request samples)
METRICS = {
    "throughput": ("output tok/s", studystats.INVERSE, True, lambda p: p.output_throughput, "e2e_ms"),
    # The median request's rate: a mean of rates is dominated by a request whose chunks arrived at once.
    "per_user": ("tok/s per user (median)", studystats.MEDIAN, True, _median_rate, "tok_s"),
    "ttft_median_ms": ("TTFT median (ms)", studystats.MEDIAN, False, lambda p: p.ttft_ms.get("median"), "ttft_ms"),
    "tpot_median_ms": ("TPOT median (ms)", studystats.MEDIAN, False, lambda p: p.tpot_ms.get("median"), "tpot_ms"),
    "ttft_p95_ms": ("TTFT p95 (ms)", studystats.SCALED, False, lambda p: p.ttft_ms.get("p95"), None),
}
START = ("start time (s)", studystats.SCALED, False)
RULES = {"throughput": "max output tok/s at level N", "single_stream": "max single-stream tok/s",
         "throughput_under_ttft": "max output tok/s at level N with TTFT p95 within a budget"}
# NCCL's documentation lists these under "Debugging": not for production, nor to be kept in scripts;
# a winner that depends on one is applied only after the user confirms.
NCCL_DEBUG_VARS = frozenset(f"NCCL_{n}" for n in (
    "ALGO", "PROTO", "BUFFSIZE", "LL_BUFFSIZE", "LL128_BUFFSIZE", "NTHREADS", "MAX_NCHANNELS", "MIN_NCHANNELS",
    "MAX_NRINGS", "MIN_NRINGS", "MAX_CTAS", "MIN_CTAS", "CHECKS_DISABLE", "CHECK_POINTERS", "LAUNCH_MODE",
    "IGNORE_CPU_AFFINITY", "IGNORE_DISABLED_P2P", "DEBUG", "DEBUG_FILE", "DEBUG_SUBSYS", "COLLNET_ENABLE",
    "COLLNET_NODE_THRESHOLD", "TOPO_FILE", "TOPO_DUMP_FILE", "GRAPH_FILE", "GRAPH_DUMP_FILE", "SET_THREAD_NAME",
    "NVB_DISABLE", "PXN_DISABLE", "P2P_PXN_LEVEL", "RUNTIME_CONNECT", "GRAPH_REGISTER", "LOCAL_REGISTER",
    "LEGACY_CUDA_REGISTER", "SET_STACK_SIZE", "GRAPH_MIXING_SUPPORT", "DMABUF_ENABLE", "P2P_NET_CHUNKSIZE",
    "P2P_NVL_CHUNKSIZE", "P2P_PCI_CHUNKSIZE", "P2P_LL_THRESHOLD", "SINGLE_RING_THRESHOLD", "LL_THRESHOLD",
    "TREE_THRESHOLD"))


def debug_vars(variant: StudyVariant) -> list[str]:
    """NCCL debugging variables the variant sets."""
    return sorted(n for n in variant.env if n in NCCL_DEBUG_VARS)


def _key(metric: str, level) -> str:
    return f"{metric}@{level}"


def _repeats(study: Study) -> dict[int, dict[str, list[studystats.Repeat]]]:
    """variant id -> "metric@level" (and "start_s") -> its repeats, from the finished trials."""
    trials = list(study.trials.filter(status=StudyTrial.Status.DONE).select_related("run"))
    points = BenchmarkPoint.objects.filter(run__in=[t.run_id for t in trials if t.run_id], repeat=0)
    by_run: dict[int, list[BenchmarkPoint]] = {}
    for p in points:
        by_run.setdefault(p.run_id, []).append(p)
    out: dict[int, dict[str, list[studystats.Repeat]]] = {}
    for t in trials:
        figures = out.setdefault(t.variant_id, {})
        if t.ready_s is not None:
            figures.setdefault("start_s", []).append(studystats.Repeat(t.ready_s))
        for p in by_run.get(t.run_id, []):
            for metric, (_, _, _, value, samples) in METRICS.items():
                v = value(p)
                if v is not None:
                    reqs = tuple((p.samples or {}).get(samples) or ()) if samples else ()
                    level = studylevels.point_level(p.kind, p.concurrency, p.rate)
                    figures.setdefault(_key(metric, level), []).append(studystats.Repeat(float(v), reqs))
    return out


def _kind(key: str) -> tuple[str, bool]:
    if key == "start_s":
        return START[1], START[2]
    _, kind, higher, _, _ = METRICS[key.split("@")[0]]
    return kind, higher


def _as_dict(obj) -> dict | None:
    return None if obj is None else {k: (round(v, 6) if isinstance(v, float) else v) for k, v in obj.__dict__.items()}


def compute(study: Study, n_boot: int = 2000) -> dict:
    """Estimates, comparisons with the baseline and verdicts per variant; the winner; the Pareto front. An adaptive
    study's comparisons are at its sequential boundary (studystats.sequential_z), whenever it stopped."""
    variants = list(study.variants.all())
    z = studystats.sequential_z(study.looks)
    repeats = _repeats(study)
    baseline = next(v for v in variants if v.is_baseline)
    base = repeats.get(baseline.pk, {})
    levels = studylevels.study_levels(study.workload)
    rows = []
    for v in variants:
        figures = repeats.get(v.pk, {})
        estimates = {k: _as_dict(studystats.estimate(r, _kind(k)[0], n_boot=n_boot)) for k, r in figures.items()}
        comparisons = {}
        if not v.is_baseline:
            for k, r in figures.items():
                if k in base:
                    kind, higher = _kind(k)
                    comparisons[k] = _as_dict(studystats.compare(base[k], r, kind, higher, n_boot=n_boot, z=z))
        rows.append({"id": v.pk, "name": v.name, "is_baseline": v.is_baseline, "failed": v.failed,
                     "engine_args": v.engine_args, "env": v.env, "debug_vars": debug_vars(v),
                     "repeats_done": len(figures.get(_key("throughput", levels[0]), [])) if levels else 0,
                     "estimates": estimates, "comparisons": comparisons})
    gpus = study.deployment.gpus.count()
    front = _pareto(rows, levels, gpus)
    winner, why = choose_winner(rows, study.rule, levels)
    return {"levels": levels, "metrics": {k: m[0] for k, m in METRICS.items()} | {"start_s": START[0]},
            "variants": rows, "pareto": front, "winner": winner, "winner_why": why, "rule": study.rule,
            "rule_text": rule_text(study.rule, levels), "gpus": gpus,
            # The winner at each level by output tok/s, and the crossover when the intervals support one.
            "per_level": studylevels.level_winners(rows, repeats, levels, choose_winner, n_boot=n_boot, z=z),
            "z": z}


def rule_text(rule: dict, levels: list[int]) -> str:
    """The winner rule in words, e.g. "the highest output tok/s at concurrency 16, if significantly better
    than the baseline's (else the baseline stays)"."""
    kind = (rule or {}).get("kind", "throughput")
    level = _rule_level(rule, levels)
    at = f"at {studylevels.label(level)}".replace("at c=", "at concurrency ")
    tail = ", if significantly better than the baseline's (else the baseline stays)"
    if kind == "single_stream":
        first = studylevels.label(levels[0] if levels else 1).replace("c=", "concurrency ")
        return f"the highest tok/s per user (median) at {first}{tail}"
    if kind == "throughput_under_ttft":
        return (f"the highest output tok/s {at} among the variants whose TTFT p95 there is "
                f"within {float(rule.get('ttft_p95_ms') or 0):g} ms{tail}")
    return f"the highest output tok/s {at}{tail}"


def _rule_level(rule: dict, levels: list):
    """The level a rule judges at: its own (a concurrency or a rate's name), else the study's highest
    concurrency, else its highest rate."""
    level = studylevels.parse_level((rule or {}).get("level") or "")
    if level is not None:
        return level
    concurrencies = [lv for lv in levels if not isinstance(lv, str)]
    return max(concurrencies) if concurrencies else (levels[-1] if levels else 1)


def _median(row: dict, key: str) -> float | None:
    """A variant's figure: the mean over its repeats, the point its interval holds (results kept before it was
    stored: the median of the repeats)."""
    est = row["estimates"].get(key)
    return est.get("value", est["median"]) if est else None


def rule_key(rule: dict, levels: list) -> str:
    """The figure ("metric@level") the rule judges variants by."""
    if (rule or {}).get("kind") == "single_stream":
        return _key("per_user", levels[0] if levels else 1)
    return _key("throughput", _rule_level(rule, levels))


def undecided(results: dict) -> list[str]:
    """The variants (names) that ran and whose verdict against the baseline on the rule's figure is neither better nor
    worse: what another round of an adaptive study would measure for."""
    key = rule_key(results.get("rule") or {}, results.get("levels") or [])
    if any(r["is_baseline"] and r["failed"] for r in results.get("variants", [])):
        return []  # nothing to judge against: more rounds would only skip their trials
    return [r["name"] for r in results.get("variants", []) if not r["is_baseline"] and not r["failed"]
            and (r["comparisons"].get(key) or {}).get("verdict") not in (studystats.BETTER, studystats.WORSE)]


def choose_winner(rows: list[dict], rule: dict, levels: list[int]) -> tuple[int | None, str]:
    """The variant the rule prefers among those that ran; it wins only when its verdict against the
    baseline on the rule's metric is "better" — otherwise the baseline stays (the difference was noise)."""
    kind = rule.get("kind", "throughput")
    level = _rule_level(rule, levels)
    key = rule_key(rule, levels)
    candidates = [r for r in rows if not r["failed"] and _median(r, key) is not None]
    if kind == "throughput_under_ttft":
        budget = float(rule.get("ttft_p95_ms") or 0)
        candidates = [r for r in candidates if (_median(r, _key("ttft_p95_ms", level)) or 0) <= budget]
    if not candidates:
        return None, "No variant has results that fit the rule."
    best = max(candidates, key=lambda r: _median(r, key))
    baseline = next((r for r in rows if r["is_baseline"]), None)
    if best["is_baseline"]:
        thin = [(r["comparisons"].get(key) or {}).get("why") for r in candidates
                if (r["comparisons"].get(key) or {}).get("verdict") == studystats.NO_VERDICT]
        if thin:
            return best["id"], f"The baseline measured highest; with {thin[0]}, there is no verdict: the baseline stays."
        return best["id"], "The baseline is the best by the rule."
    comparison = best["comparisons"].get(key) or {}
    verdict = comparison.get("verdict")
    if verdict == studystats.NO_VERDICT:
        return (baseline["id"] if baseline else None), (
            f"{best['name']} measured highest, but with {comparison.get('why')}; the baseline stays.")
    if verdict != studystats.BETTER:
        return (baseline["id"] if baseline else None), (
            f"{best['name']} measured highest, but not significantly better than the baseline: the baseline stays.")
    return best["id"], f"{best['name']} is significantly better than the baseline by the rule."


def _pareto(rows: list[dict], levels: list[int], gpus: int) -> list[dict]:
    """tok/s per user against output tok/s (and output tok/s per GPU, on GPUs only) for each variant and
    level; `front` marks the points no other point beats on both."""
    points = []
    for r in rows:
        for level in levels:
            output, per_user = _median(r, _key("throughput", level)), _median(r, _key("per_user", level))
            if output is not None and per_user is not None:
                points.append({"variant": r["id"], "name": r["name"], "level": level, "output_tok_s": round(output, 1),
                               "per_gpu": round(output / gpus, 1) if gpus else None, "per_user": round(per_user, 2)})
    front = set(studystats.pareto([(f"{p['variant']}@{p['level']}", p["output_tok_s"], p["per_user"]) for p in points]))
    # The front among the variants at the same level too: which settings are worth having at that load.
    at_level = set()
    for level in levels:
        at_level |= set(studystats.pareto([(f"{p['variant']}@{p['level']}", p["output_tok_s"], p["per_user"])
                                          for p in points if p["level"] == level]))
    for p in points:
        p["front"] = f"{p['variant']}@{p['level']}" in front
        p["level_front"] = f"{p['variant']}@{p['level']}" in at_level
    return points


def finishing_variant(study: Study) -> StudyVariant | None:
    """What runs at the end: the winner when asked for and found (and not cancelled), else the baseline."""
    if study.finish_with != "winner" or study.cancel_requested:
        return None
    winner = (study.results or {}).get("winner")
    variant = study.variants.filter(pk=winner, is_baseline=False).first() if winner else None
    return variant


def trial_times(trial: StudyTrial) -> tuple[dict, float | None]:
    """(seconds per start-up phase of the trial's load, the panel's own overhead): the overhead is the
    trial's wall time less the plan's steps (stop, memory, launch, load, smoke test) and the benchmark run."""
    events = list(DeploymentEvent.objects.filter(deployment_id=trial.study.deployment_id, started__gte=trial.started,
                                                 ended__isnull=False).exclude(step="queued").order_by("started"))
    load = next((e for e in events if e.step == "load"), None)
    startup = (load.data or {}).get("totals") or {} if load else {}
    if trial.finished is None or trial.run_id is None or not events:
        return startup, None
    run = BenchmarkRun.objects.filter(pk=trial.run_id).first()
    if not run or not run.started or not run.finished:
        return startup, None
    plan_steps = [e for e in events if e.started <= (trial.ready_at or trial.finished) and e.step != "queued"]
    engine_s = sum((e.ended - e.started).total_seconds() for e in plan_steps if e.step != "load") + (
        (load.ended - load.started).total_seconds() if load else 0.0)
    bench_s = (run.finished - run.started).total_seconds()
    wall = (trial.finished - trial.started).total_seconds()
    return startup, round(max(0.0, wall - engine_s - bench_s), 3)


def _cell(trial: StudyTrial, points: dict) -> dict:
    return {"id": trial.pk, "variant": trial.variant_id, "repeat": trial.repeat, "status": trial.status,
            "error": trial.error, "run": trial.run_id, "ready_s": trial.ready_s, "overhead_s": trial.overhead_s,
            "startup": trial.startup, "points": points.get(trial.run_id, {})}


def took_s(study: Study) -> float | None:
    """Seconds from the study's start to its end, once ended (to set against its estimate)."""
    return round((study.finished - study.started).total_seconds(), 1) if study.finished and study.started else None


def left_s(study: Study, trials: list[StudyTrial], now=None) -> float | None:
    """Seconds a study in progress still needs, from its own trials' wall times once one has ended: the trials
    left at the median wall (the current one less what it has run), and the closing redeploy. None before."""
    if study.status in Study.TERMINAL:
        return None
    walls = [(t.finished - t.started).total_seconds() for t in trials
             if t.status not in StudyTrial.OPEN and t.started and t.finished]
    if not walls:
        return None
    now = now or timezone.now()
    wall = statistics.median(walls)
    left = 0.0
    for t in trials:
        if t.status in StudyTrial.OPEN:
            left += max(0.0, wall - (now - t.started).total_seconds()) if t.started else wall
    readies = [t.ready_s for t in trials if t.ready_s is not None]
    return round(left + (statistics.median(readies) if readies else 0.0), 1)


def study_live(study: Study) -> dict:
    """The study as its page shows it: status, variants, every trial with its levels' tok/s (the matrix),
    the trial in progress and, once done, the results."""
    trials = list(study.trials.select_related("variant"))
    run_ids = [t.run_id for t in trials if t.run_id]
    points: dict = {}
    for p in BenchmarkPoint.objects.filter(run__in=run_ids, repeat=0).values(
            "run_id", "kind", "concurrency", "rate", "output_throughput", "tok_s_per_user", "ttft_ms"):
        level = studylevels.point_level(p["kind"], p["concurrency"], p["rate"])
        points.setdefault(p["run_id"], {})[str(level)] = {
            "tok_s": round(p["output_throughput"], 1), "per_user": round(p["tok_s_per_user"], 2),
            "ttft_median_ms": round((p["ttft_ms"] or {}).get("median", 0.0), 1)}
    current = next((t for t in trials if t.status in (StudyTrial.Status.DEPLOYING, StudyTrial.Status.BENCHMARKING)), None)
    done = sum(t.status not in StudyTrial.OPEN for t in trials)
    return {"id": study.pk, "status": study.status, "status_display": study.get_status_display(), "error": study.error,
            "pause_requested": study.pause_requested, "cancel_requested": study.cancel_requested,
            "levels": studylevels.study_levels(study.workload), "trials_done": done, "trials_total": len(trials),
            "estimate_s": study.estimate_s, "estimate_basis": study.estimate_basis, "took_s": took_s(study),
            "left_s": left_s(study, trials),
            "variants": [{"id": v.pk, "name": v.name, "is_baseline": v.is_baseline, "failed": v.failed,
                          "engine_args": v.engine_args, "env": v.env, "debug_vars": debug_vars(v)}
                         for v in study.variants.all()],
            "trials": [_cell(t, points) for t in trials],
            "current": current and {"trial": current.pk, "variant": current.variant_id, "status": current.status,
                                    "run": current.run_id, "deployment": study.deployment_id},
            "results": study.results or None}


EXPORT_COLUMNS = ["study", "variant", "baseline", "repeat", "trial_status", "error", "ready_s", "overhead_s", "run",
                  "concurrency", "level_kind", "rate", "output_throughput", "tok_s_per_user", "ttft_median_ms", "ttft_p95_ms",
                  "tpot_median_ms"]


def export_csv(study: Study) -> str:
    """One row per trial and level (a trial without results: one row with its status and error); no cell a
    spreadsheet would run as a formula (plumbing/csvsafe.py)."""
    trials = list(study.trials.select_related("variant"))
    points: dict = {}
    for p in BenchmarkPoint.objects.filter(run__in=[t.run_id for t in trials if t.run_id]):
        points.setdefault(p.run_id, []).append(p)
    rows = []
    for t in trials:
        head = [study.pk, t.variant.name, t.variant.is_baseline, t.repeat, t.status, t.error, t.ready_s, t.overhead_s, t.run_id]
        levels = points.get(t.run_id) if t.status == StudyTrial.Status.DONE else None
        if not levels:
            rows.append(head + [""] * (len(EXPORT_COLUMNS) - len(head)))
        for p in levels or []:
            rows.append(head + [p.concurrency, *selectors.level_cells(p), p.output_throughput, p.tok_s_per_user,
                                p.ttft_ms.get("median"), p.ttft_ms.get("p95"), p.tpot_ms.get("median")])
    return csvsafe.rows_text(EXPORT_COLUMNS, rows)
