"""Reads for benchmark pages and exports: comparisons, environment diffs, CSV rows."""
from benchmarks import csvsafe
from benchmarks.models import BenchmarkRun
from deployments import live

CSV_COLUMNS = ["run", "name", "target", "concurrency", "num_requests", "failed_requests", "duration_s",
               "request_throughput", "output_throughput", "total_token_throughput", "input_tokens", "output_tokens",
               "reasoning_tokens", "content_tokens", "tok_s_per_user", "ttft_median_ms", "ttft_p99_ms",
               "ttft_vllm_bench_median_ms", "ttfc_median_ms", "tpot_median_ms", "itl_median_ms", "itl_per_token_median_ms", "e2e_median_ms",
               "prompt_tokens_requested", "prompt_tokens_mean"]


def runs_with_points(ids) -> list[BenchmarkRun]:
    return list(BenchmarkRun.objects.filter(pk__in=ids).select_related("deployment").prefetch_related("points").order_by("pk"))


def csv_rows(runs):
    for run in runs:
        for p in run.points.all():
            yield [run.pk, run.name, run.target, p.concurrency, p.num_requests, p.failed_requests, p.duration_s,
                   p.request_throughput, p.output_throughput, p.total_token_throughput, p.input_tokens, p.output_tokens,
                   p.reasoning_tokens, p.content_tokens, p.tok_s_per_user, p.ttft_ms.get("median"), p.ttft_ms.get("p99"),
                   p.ttft_vllm_bench_ms.get("median"), p.ttfc_ms.get("median"), p.tpot_ms.get("median"), p.itl_ms.get("median"),
                   p.itl_per_token_ms.get("median"), p.e2e_ms.get("median"), p.prompt_tokens_requested, p.prompt_tokens_mean]


def export_csv(runs) -> str:
    """One CSV row per level of each run, with a header (the pages' and the API's export); no cell a
    spreadsheet would run as a formula (benchmarks/csvsafe.py)."""
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


def _settings(env: dict) -> dict[str, str]:
    """A run's environment flattened; each engine flag written as on the command line (`--enforce-eager`,
    `--max-num-seqs 8`), so what changed reads like, and pastes as, what the engine got."""
    from deployments.engineargs import argv_words

    flat = _flatten({k: v for k, v in env.items() if k != "engine_args"})
    for flag, value in (env.get("engine_args") or {}).items():
        flat[f"engine_args.{flag}"] = " ".join(argv_words({flag: value}))
    return flat


def environment_diff(a: BenchmarkRun, b: BenchmarkRun) -> list[tuple[str, str, str]]:
    """(setting, value in a, value in b) for every setting that differs: flags, env vars, engine, GPUs, model."""
    fa, fb = _settings(a.environment), _settings(b.environment)
    pa, pb = _flatten({"params": {k: v for k, v in a.params.items() if k != "prompts"}}), _flatten(
        {"params": {k: v for k, v in b.params.items() if k != "prompts"}})
    fa.update(pa)
    fb.update(pb)
    return [(key, fa.get(key, "—"), fb.get(key, "—")) for key in sorted(set(fa) | set(fb)) if fa.get(key) != fb.get(key)]


def export_json(runs) -> list[dict]:
    return [{"id": r.pk, "name": r.name, "target": r.target, "status": r.status, "params": {k: v for k, v in r.params.items() if k != "prompts"},
             "environment": r.environment, "single_stream_tok_s": r.single_stream_tok_s, "warnings": r.warnings,
             "started": r.started, "finished": r.finished, "points": [live.run_point_data(p) for p in r.points.all()]} for r in runs]


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

