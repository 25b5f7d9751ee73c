"""Reads for benchmark pages and exports: comparisons, environment diffs, CSV rows."""
from benchmarks import payloads
from benchmarks.models import BenchmarkRun
from benchmarks.runner.saturation import representatives, saturation_point
from benchmarks.runner.spec import LevelResult
from plumbing import csvsafe

CSV_COLUMNS = ["run", "name", "target", "concurrency", "num_requests", "failed_requests", "duration_s",
               "request_throughput", "output_throughput", "total_token_throughput", "input_tokens", "output_tokens",
               "reasoning_tokens", "content_tokens", "tok_s_per_user", "ttft_median_ms", "ttft_p99_ms",
               "ttft_vllm_bench_median_ms", "ttfc_median_ms", "tpot_median_ms", "itl_median_ms", "itl_per_token_median_ms", "e2e_median_ms",
               "prompt_tokens_requested", "prompt_tokens_mean", "energy_j", "watts_per_gpu",
               "level_kind", "rate", "achieved_rate", "lag_p99_ms", "slot_wait_p99_ms",
               "repeat", "goodput", "slo_attainment_pct", "slo_met", "prefix_cache_hit_rate", "prefix_reusable_share",
               "energy_net_j", "idle_watts", "rejected"]


def runs_with_points(ids) -> list[BenchmarkRun]:
    return list(BenchmarkRun.objects.filter(pk__in=ids).select_related("deployment").prefetch_related("points").order_by("pk"))


def level_cells(p) -> list:
    """A level's kind and, for a rate level, its requests/s asked (empty for a concurrency level, whose
    `concurrency` column says it; a rate level's is its cap, 0 for none)."""
    return [p.kind, p.rate if p.kind == p.Kind.RATE else None]


def csv_rows(runs):
    for run in runs:
        for p in run.points.all():
            yield [run.pk, run.name, run.target, p.concurrency, p.num_requests, p.failed_requests, p.duration_s,
                   p.request_throughput, p.output_throughput, p.total_token_throughput, p.input_tokens, p.output_tokens,
                   p.reasoning_tokens, p.content_tokens, p.tok_s_per_user, p.ttft_ms.get("median"), p.ttft_ms.get("p99"),
                   p.ttft_vllm_bench_ms.get("median"), p.ttfc_ms.get("median"), p.tpot_ms.get("median"), p.itl_ms.get("median"),
                   p.itl_per_token_ms.get("median"), p.e2e_ms.get("median"), p.prompt_tokens_requested, p.prompt_tokens_mean,
                   p.energy_j, p.watts_per_gpu, *level_cells(p),
                   p.achieved_rate if p.kind == p.Kind.RATE else None, (p.lag_ms or {}).get("p99"),
                   (p.slot_wait_ms or {}).get("p99"), p.repeat, p.goodput, (p.slo or {}).get("attainment_pct"),
                   (p.slo or {}).get("met"), (p.server_metrics.get("prefix_cache") or {}).get("hit_rate"),
                   (p.prefix_reuse or {}).get("share"), p.energy_net_j, run.idle_watts, p.rejected]


def export_csv(runs) -> str:
    """One CSV row per level of each run, with a header (the pages' and the API's export); no cell a
    spreadsheet would run as a formula (plumbing/csvsafe.py)."""
    return csvsafe.rows_text(CSV_COLUMNS, csv_rows(runs))


def _flatten(env: dict, prefix: str = "") -> dict[str, str]:
    flat = {}
    for key, value in env.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, list):
            flat[name] = ", ".join(str(v.get("name", v)) if isinstance(v, dict) else str(v) for v in value)
        else:
            flat[name] = "" if value is None else str(value)
    return flat


# Environment keys that are not settings: measurements of the engine (seconds per start-up phase) and
# the command line, which restates the flags and the port. "What changed" compares settings only.
NOT_SETTINGS = frozenset({"startup", "engine_command"})


def _settings(env: dict) -> dict[str, str]:
    """A run's settings flattened; each engine flag written as on the command line (`--enforce-eager`,
    `--max-num-seqs 8`), so what changed reads like, and pastes as, what the engine got."""
    from deployments.userflags import argv_words

    flat = _flatten({k: v for k, v in env.items() if k != "engine_args" and k not in NOT_SETTINGS})
    for flag, value in (env.get("engine_args") or {}).items():
        flat[f"engine_args.{flag}"] = " ".join(argv_words({flag: value}))
    return flat


def shown_params(params: dict) -> dict:
    """A run's params as exports and comparisons show them: without uploaded prompts or a workload's file data
    (its name and settings stay)."""
    shown = {k: v for k, v in params.items() if k != "prompts"}
    if isinstance(shown.get("workload"), dict):
        shown["workload"] = {k: v for k, v in shown["workload"].items() if k not in ("entries", "requests")}
    return shown


def _workload(run: BenchmarkRun) -> dict[str, str]:
    return _flatten({"params": shown_params(run.params)})


def environment_diff(a: BenchmarkRun, b: BenchmarkRun) -> list[tuple[str, str, str]]:
    """(setting, value in a, value in b) for every setting that differs: flags, env vars, engine, GPUs,
    model, workload; never a measurement (start-up seconds: see startup_text)."""
    fa, fb = {**_settings(a.environment), **_workload(a)}, {**_settings(b.environment), **_workload(b)}
    return [(key, fa.get(key, "—"), fb.get(key, "—")) for key in sorted(set(fa) | set(fb)) if fa.get(key) != fb.get(key)]


def startup_text(env: dict) -> str:
    """The measured start-up of the engine a run measured, in words: "ready in 23.1 s, warm: compile cache (weights
    3.0 s, …)"; cold or warm where its load recorded it."""
    startup = (env or {}).get("startup") or {}
    if not startup.get("ready_s"):
        return ""
    phases = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in (startup.get("totals") or {}).items()
                       if isinstance(v, (int, float)))
    kind = f", {startup['start']}" + (f": {' + '.join(startup.get('warm_by') or [])}" if startup.get("warm_by") else "") \
        if startup.get("start") else ""
    return f"ready in {startup['ready_s']:.1f} s{kind}" + (f" ({phases})" if phases else "")


def environment_rows(env: dict) -> list[tuple[str, str]]:
    """A run's environment as its page lists it, one short line per item: flags as on the command line,
    variables as NAME=value, GPUs by name, start-up in words (the full command line is shown apart)."""
    from deployments.userflags import argv_words

    labels = {"deployment": "Deployment", "model": "Model", "model_commit": "Commit", "node": "Node",
              "engine_version": "Engine", "engine_args": "Flags", "env": "Environment", "gpus": "GPUs",
              "model_path": "Model folder", "startup": "Start-up", "base_url": "URL"}
    rows = []
    for key, value in (env or {}).items():
        if key == "engine_command":
            continue
        if key == "engine_args":
            text = " ".join(argv_words(value or {}))
        elif key == "env":
            text = " ".join(f"{k}={v}" for k, v in (value or {}).items())
        elif key == "gpus":
            text = ", ".join(f"{g.get('index')}: {g.get('name')}" for g in value or []) or "none (CPU)"
        elif key == "startup":
            text = startup_text(env)
        elif isinstance(value, dict):
            text = ", ".join(f"{k}={v}" for k, v in _flatten(value).items())
        elif isinstance(value, list):
            text = ", ".join(map(str, value))
        else:
            text = "" if value is None else str(value)
        rows.append((labels.get(key, key.replace("_", " ").capitalize()), text or "—"))
    return rows


def run_labels(runs: list[BenchmarkRun]) -> dict[int, str]:
    """A name per run that tells the runs apart: "#12 qwen3 2026-12-01 10:04"; two alike also get the first
    setting in which they differ ("#13 … · NCCL_PROTO=LL")."""
    labels = {r.pk: f"#{r.pk} {r.name}" for r in runs}
    for r in runs:
        twins = [o for o in runs if o.pk != r.pk and o.name == r.name]
        if twins:
            diff = environment_diff(twins[0], r)
            if diff:
                key, _, value = diff[0]
                labels[r.pk] += f" · {value}" if key.startswith("engine_args.") else f" · {key.split('.')[-1]}={value}"
    return labels


def export_json(runs) -> list[dict]:
    return [{"id": r.pk, "name": r.name, "target": r.target, "status": r.status, "params": shown_params(r.params),
             "environment": r.environment, "single_stream_tok_s": r.single_stream_tok_s, "warnings": r.warnings,
             "capacity": r.capacity,
             "started": r.started, "finished": r.finished, "points": [payloads.run_point_data(p) for p in r.points.all()]} for r in runs]


CPU_STREAMS_PER_CORE = 16  # a CPU engine's batch is bounded by its cores long before by its max-num-seqs


def default_levels(deployment) -> list[int]:
    """Sweep levels that fit what the deployment can run at once: powers of two up to its --max-num-seqs
    (beyond it requests only queue in the engine); on a CPU node also at most 16 per core (64 while
    the node has not reported its cores). The sweep still stops early once the engine saturates."""
    from benchmarks import runner

    limit = int((deployment.engine_args.get("max-num-seqs") or 0) if deployment else 0)
    if deployment and not deployment.gpu_indices:
        cores = deployment.node.cpu_count
        cap = max(8, CPU_STREAMS_PER_CORE * cores) if cores else 64
        limit = min(limit, cap) if limit else cap
    return [c for c in runner.DEFAULT_LEVELS if not limit or c <= limit]



def max_num_seqs(run: BenchmarkRun) -> int | None:
    """The engine's --max-num-seqs when the run's environment records it (a deployment's flags)."""
    value = ((run.environment or {}).get("engine_args") or {}).get("max-num-seqs")
    try:
        return int(value) if value not in (None, "", True, False) else None
    except (TypeError, ValueError):
        return None


def run_saturation(run: BenchmarkRun, points=None) -> dict | None:
    """Where the sweep saturated and why, from its stored levels: {"level": 16 or None, "reason", "text"};
    None before two levels are in (or one, once the run has ended)."""
    points = list(run.points.all()) if points is None else points
    points = [p for p in points if p.kind == p.Kind.CONCURRENCY]  # the sweep's rule is about concurrency levels
    if len(points) < 2 and run.status not in BenchmarkRun.TERMINAL or not points:
        return None
    levels = [LevelResult(concurrency=p.concurrency, num_requests=p.num_requests, completed=p.num_requests - p.failed_requests,
                          output_throughput=p.output_throughput, e2e_ms=p.e2e_ms or {}, server_metrics=p.server_metrics or {})
              for p in sorted(points, key=lambda p: (p.concurrency, p.repeat))]
    level, reason = saturation_point(representatives(levels), max_num_seqs(run))
    text = f"Saturated at c={level}: {reason}." if level else f"{reason[:1].upper()}{reason[1:]}."
    return {"level": level, "reason": reason, "text": text}
