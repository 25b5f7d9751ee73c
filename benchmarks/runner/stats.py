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


def arrivals(record: RequestRecord, counts: list[float]) -> list[tuple[float, float]]:
    """(time, tokens) of each read that brought tokens. Chunks stamped in one read share its time: when
    the server's writes coalesce (vLLM on a busy host sends several events at once) the gaps between
    them were never observed, so one read with m chunks is one arrival of all their tokens."""
    out: list[list[float]] = []
    for t, k in zip(record.chunk_times, counts):
        if out and out[-1][0] == t:
            out[-1][1] += k
        else:
            out.append([t, k])
    return [(t, k) for t, k in out if k > 0] or [(t, k) for t, k in out[:1]]


def chunk_gaps(arrived: list[tuple[float, float]]) -> list[float]:
    """The gap before each arrival after the first (ITL per chunk, a read being what a client can time)."""
    return [arrived[j][0] - arrived[j - 1][0] for j in range(1, len(arrived))]


def per_token_gaps(arrived: list[tuple[float, float]]) -> list[float]:
    """Ours: an arrival of k tokens after the first contributes k gaps of gap/k (k rounded, at least 1);
    so no gap that brought tokens reads 0, and gaps sum to the decode time."""
    gaps = []
    for j in range(1, len(arrived)):
        k = arrived[j][1]
        gaps.extend([(arrived[j][0] - arrived[j - 1][0]) / k] * max(1, round(k)))
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


def timed_decode(record: RequestRecord, arrived: list[tuple[float, float]]) -> bool:
    """Whether a request's decode is something a client timed: more than one token, and those after its first in at
    least two reads (one, for a two-token answer). Tokens after the first that all came in one read (or in the read of
    the first) have no decode a client could time: their TPOT would be that one gap shared out (0.01 ms was seen,
    beside 2 ms per token), their rate absurd. Such a request counts for TTFT and E2E, not for the decode figures."""
    return record.output_tokens > 1 and len(arrived) - 1 >= min(2, record.output_tokens - 1)


def summarize(concurrency: int, records: list[RequestRecord], warmup: int = 0, workers: int = 1,
              cancelled: bool = False) -> LevelResult:
    """A LevelResult from the measured (non-warmup) records of one level."""
    ok = [r for r in records if r.success]
    result = LevelResult(concurrency=concurrency, num_requests=len(records), completed=len(ok),
                         failed_requests=len(records) - len(ok), warmup_requests=warmup, workers=workers,
                         cancelled=cancelled, records=records)
    errors = []
    for r in records:
        result.timeouts += r.timed_out
        result.rejected += r.rejected
        if r.error and not (r.timed_out or r.rejected) and r.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(r.error)
    result.errors = errors
    if records:
        result.duration_s = max(r.done for r in records) - min(r.start for r in records)
    ttfts, bench_ttfts, ttfcs, tpots, itls, itls_token, e2es = [], [], [], [], [], [], []
    sources, exact, decode_tokens, decode_s = set(), True, 0, 0.0
    for r in ok:
        times = r.chunk_times
        ttft, e2e = times[0] - r.start, times[-1] - r.start
        ttfts.append(ttft)
        bench_ttfts.append(r.ttft_vllm_bench)
        e2es.append(e2e)
        if r.ttfc is not None:
            ttfcs.append(r.ttfc)
        counts, exact_counts = chunk_token_counts(r)
        exact = exact and exact_counts
        arrived = arrivals(r, counts)
        if e2e > ttft and timed_decode(r, arrived):
            tpots.append((e2e - ttft) / (r.output_tokens - 1))
            decode_tokens += r.output_tokens - 1
            decode_s += e2e - ttft

        itls.extend(chunk_gaps(arrived))
        itls_token.extend(per_token_gaps(arrived))
        reasoning, content, source = reasoning_split(r, counts, exact_counts)
        result.reasoning_tokens += reasoning
        result.content_tokens += content
        sources.add(source)
        result.input_tokens += r.prompt_tokens
        result.output_tokens += r.output_tokens
    result.ttft_ms, result.ttfc_ms = distribution(ttfts), distribution(ttfcs) if ttfcs else {}
    result.ttft_vllm_bench_ms = distribution(bench_ttfts)
    # No decode seen (one token each, or every request in one read): no figure, rather than a 0 that
    # reads as "instant".
    result.tpot_ms, result.itl_ms = distribution(tpots) if tpots else {}, distribution(itls) if itls else {}
    result.itl_per_token_ms = distribution(itls_token) if itls_token else {}
    result.e2e_ms = distribution(e2es)
    # Total decode tokens over total decode time: what 1 / TPOT says. A mean of per-request rates is
    # ruled by the request whose chunks came in few reads (a tiny decode time, a huge rate).
    result.tok_s_per_user = decode_tokens / decode_s if decode_s > 0 else 0.0
    result.tokens_per_chunk = "usage" if ok and exact else "estimated"
    sources.discard("none")
    result.reasoning_split = sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
    result.prompt_tokens_mean = result.input_tokens / len(ok) if ok else 0.0
    if result.duration_s > 0:
        result.request_throughput = result.completed / result.duration_s
        result.output_throughput = result.output_tokens / result.duration_s
        result.total_token_throughput = (result.input_tokens + result.output_tokens) / result.duration_s
    return result


def _spread_ms(values_s: list[float]) -> dict[str, float]:
    """p50, p99, max and mean in ms (zeros when empty)."""
    values = sorted(values_s)
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
    return {"p50": percentile(values, 50) * 1000.0, "p99": percentile(values, 99) * 1000.0,
            "max": values[-1] * 1000.0, "mean": math.fsum(values) / len(values) * 1000.0}


def schedule_figures(records: list[RequestRecord]) -> dict:
    """A rate level's schedule as it was kept: the rate sent ((n - 1) ÷ first to last send), the lag of
    each send behind its due time, and the waits for a slot under max_concurrency (part of the lag). Only
    scheduled sends count: a multi-turn level's first turns (its later turns follow think times, due 0)."""
    sent = [r for r in records if r.start and r.due]
    starts = sorted(r.start for r in sent)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    waits = [r.slot_wait for r in sent if r.slot_wait > 0]
    return {"achieved_rate": (len(starts) - 1) / span if span > 0 else 0.0,
            "lag_ms": _spread_ms([r.start - r.due for r in sent]),
            "slot_wait_ms": {**_spread_ms(waits), "count": len(waits)}}


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
        if e2e > first and timed_decode(r, arrivals(r, chunk_token_counts(r)[0])):
            tok_s.append(round((r.output_tokens - 1) / (e2e - first), 3))
            tpot.append(round((e2e - first) / (r.output_tokens - 1) * 1000.0, 4))

    def thin(values):
        step = max(1, -(-len(values) // limit))
        return values[::step]

    return {"tok_s": thin(tok_s), "ttft_ms": thin(ttft), "tpot_ms": thin(tpot), "e2e_ms": thin(e2es)}
