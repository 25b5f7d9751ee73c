"""Per-level metrics from request records, with vllm bench serve's definitions (numpy-free)."""
import math

from .spec import LevelResult, RequestRecord

PERCENTILES = (90, 95, 99)
MAX_ERRORS = 10


def percentile(sorted_values: list[float], q: float) -> float:
    """numpy.percentile's default ("linear"): interpolate between the two nearest ranks."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def distribution(values_s: list[float]) -> dict[str, float]:
    """mean, median, std (population, like numpy.std), p90, p95, p99, in milliseconds; zeros if empty."""
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    values = sorted(values_s)
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    out = {"mean": mean, "median": percentile(values, 50), "std": std}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return {key: value * 1000.0 for key, value in out.items()}


def chunk_token_counts(record: RequestRecord) -> tuple[list[float], bool]:
    """Tokens carried by each token chunk: from per-chunk usage when sent (exact), else spread evenly."""
    n = len(record.chunk_times)
    if record.chunk_tokens is not None and len(record.chunk_tokens) == n:
        return [float(k) for k in record.chunk_tokens], True
    return [record.output_tokens / n] * n if n else [], False


def per_token_gaps(record: RequestRecord, counts: list[float]) -> list[float]:
    """Ours: a chunk with k tokens after the first contributes k gaps of gap/k (k rounded, at least 1)."""
    times, gaps = record.chunk_times, []
    for j in range(1, len(times)):
        k = counts[j]
        if k <= 0:
            continue
        gaps.extend([(times[j] - times[j - 1]) / k] * max(1, round(k)))
    return gaps


def reasoning_split(record: RequestRecord, counts: list[float], exact_counts: bool) -> tuple[int, int, str]:
    """(reasoning, content) tokens and where the split came from: usage, per-chunk usage, or chunk counts."""
    out, kinds = record.output_tokens, record.chunk_kinds
    # vLLM 0.32 with --reasoning-parser deepseek_r1 reports reasoning_tokens 0 for a stream of
    # nothing but reasoning deltas: a zero contradicted by the chunks is not believed.
    if record.reasoning_tokens is not None and (record.reasoning_tokens or b"r" not in kinds):
        reasoning = min(out, record.reasoning_tokens)
        return reasoning, out - reasoning, "usage"
    if not kinds:
        return 0, out, "none"
    if exact_counts:
        reasoning = int(sum(k for k, kind in zip(counts, kinds) if kind == ord("r")))
        return reasoning, out - reasoning, "chunk_usage"
    reasoning = round(out * kinds.count(b"r") / len(kinds))
    return reasoning, out - reasoning, "chunks"


def summarize(concurrency: int, records: list[RequestRecord], warmup: int = 0, workers: int = 1,
              cancelled: bool = False) -> LevelResult:
    """A LevelResult from the measured (non-warmup) records of one level."""
    ok = [r for r in records if r.success]
    result = LevelResult(concurrency=concurrency, num_requests=len(records), completed=len(ok),
                         failed_requests=len(records) - len(ok), warmup_requests=warmup, workers=workers,
                         cancelled=cancelled, records=records)
    errors = []
    for r in records:
        if r.error and r.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(r.error)
    result.errors = errors
    if records:
        result.duration_s = max(r.done for r in records) - min(r.start for r in records)
    ttfts, bench_ttfts, ttfcs, tpots, itls, itls_token, e2es, per_user = [], [], [], [], [], [], [], []
    sources, exact = set(), True
    for r in ok:
        times = r.chunk_times
        ttft, e2e = times[0] - r.start, times[-1] - r.start
        ttfts.append(ttft)
        bench_ttfts.append(r.ttft_vllm_bench)
        e2es.append(e2e)
        if r.ttfc is not None:
            ttfcs.append(r.ttfc)
        if r.output_tokens > 1:
            tpots.append((e2e - ttft) / (r.output_tokens - 1))
        if e2e > ttft and r.output_tokens:
            per_user.append(r.output_tokens / (e2e - ttft))
        itls.extend(times[j] - times[j - 1] for j in range(1, len(times)))
        counts, exact_counts = chunk_token_counts(r)
        exact = exact and exact_counts
        itls_token.extend(per_token_gaps(r, counts))
        reasoning, content, source = reasoning_split(r, counts, exact_counts)
        result.reasoning_tokens += reasoning
        result.content_tokens += content
        sources.add(source)
        result.input_tokens += r.prompt_tokens
        result.output_tokens += r.output_tokens
    result.ttft_ms, result.ttfc_ms = distribution(ttfts), distribution(ttfcs) if ttfcs else {}
    result.ttft_vllm_bench_ms = distribution(bench_ttfts)
    result.tpot_ms, result.itl_ms = distribution(tpots), distribution(itls)
    result.itl_per_token_ms, result.e2e_ms = distribution(itls_token), distribution(e2es)
    result.tok_s_per_user = math.fsum(per_user) / len(per_user) if per_user else 0.0
    result.tokens_per_chunk = "usage" if ok and exact else "estimated"
    sources.discard("none")
    result.reasoning_split = sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
    result.prompt_tokens_mean = result.input_tokens / len(ok) if ok else 0.0
    if result.duration_s > 0:
        result.request_throughput = result.completed / result.duration_s
        result.output_throughput = result.output_tokens / result.duration_s
        result.total_token_throughput = (result.input_tokens + result.output_tokens) / result.duration_s
    return result


MAX_SAMPLES = 2000


def request_samples(records: list[RequestRecord], limit: int = MAX_SAMPLES) -> dict[str, list[float]]:
    """Per-request figures of the successful measured requests, for a study's bootstrap: output tok/s
    per user (after the first token), TTFT, TPOT and end-to-end time in ms; at most `limit` of each,
    evenly picked."""
    tok_s, ttft, tpot, e2es = [], [], [], []
    for r in records:
        if not r.success or not r.chunk_times:
            continue
        first, e2e = r.ttft, r.e2e
        ttft.append(round(first * 1000.0, 3))
        e2es.append(round(e2e * 1000.0, 3))
        if e2e > first and r.output_tokens:
            tok_s.append(round(r.output_tokens / (e2e - first), 3))
        if r.output_tokens > 1:
            tpot.append(round((e2e - first) / (r.output_tokens - 1) * 1000.0, 4))

    def thin(values):
        step = max(1, -(-len(values) // limit))
        return values[::step]

    return {"tok_s": thin(tok_s), "ttft_ms": thin(ttft), "tpot_ms": thin(tpot), "e2e_ms": thin(e2es)}
