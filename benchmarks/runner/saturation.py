"""When a sweep may stop: the engine is saturated once more concurrency buys no throughput (no Django).

Saturated after a level when its output throughput gained less than FLAT_GAIN over the best level
before it, and either the median end-to-end latency rose by LATENCY_RISE over the previous level or
the engine's waiting queue (vllm:num_requests_waiting, when scraped) grew. Higher levels would only
measure queueing, at the price of minutes on a small box.
"""
from .spec import LevelResult

FLAT_GAIN = 0.10  # throughput within 10 % of the best so far is flat
LATENCY_RISE = 0.25  # median E2E up 25 % on the previous level is climbing


def representatives(levels: list[LevelResult]) -> list[LevelResult]:
    """One result per level, in the order the levels ran: of a level's repeats, the one of median output throughput
    (the lower middle of an even count), so the rule reads a level as its repeats do, not its luckiest one."""
    by_level: dict[tuple, list[LevelResult]] = {}
    for lv in levels:
        by_level.setdefault((lv.kind, lv.concurrency, lv.rate), []).append(lv)
    picked = []
    for repeats in by_level.values():
        done = sorted((lv for lv in repeats if lv.completed and not lv.cancelled), key=lambda lv: lv.output_throughput)
        picked.append(done[(len(done) - 1) // 2] if done else repeats[-1])
    return picked


def _waiting(level: LevelResult) -> float | None:
    gauge = (level.server_metrics or {}).get("num_requests_waiting")
    return gauge.get("max") if isinstance(gauge, dict) else None


def saturated(levels: list[LevelResult]) -> str:
    """Why the engine is saturated at the last of `levels` (run in order), or "" if it is not."""
    done = [lv for lv in levels if lv.completed and not lv.cancelled]
    if len(done) < 2:
        return ""
    last, previous = done[-1], done[-2]
    best = max(done[:-1], key=lambda lv: lv.output_throughput)
    if best.output_throughput <= 0 or last.output_throughput >= best.output_throughput * (1 + FLAT_GAIN):
        return ""
    flat = (f"output throughput {last.output_throughput:.0f} tok/s at concurrency {last.concurrency} against "
            f"{best.output_throughput:.0f} at {best.concurrency}")
    e2e_last, e2e_previous = last.e2e_ms.get("median", 0.0), previous.e2e_ms.get("median", 0.0)
    if e2e_previous > 0 and e2e_last >= e2e_previous * (1 + LATENCY_RISE):
        return f"{flat}, while median latency rose from {e2e_previous:.0f} to {e2e_last:.0f} ms"
    waiting_last, waiting_previous = _waiting(last), _waiting(previous)
    if waiting_last and waiting_last > (waiting_previous or 0):
        return f"{flat}, while up to {waiting_last:.0f} requests waited in the engine's queue"
    return ""


KV_FULL = 0.90  # KV-cache usage from which the cache, not the batch size, holds requests back


def _gauge(level: LevelResult, name: str) -> float | None:
    gauge = (level.server_metrics or {}).get(name)
    return gauge.get("max") if isinstance(gauge, dict) else None


def limits(level: LevelResult, max_num_seqs: int | None) -> list[str]:
    """The engine limits its gauges show reached at the level: max-num-seqs (as many running as it
    allows) and the KV cache (nearly full). Only what a gauge shows; nothing is inferred."""
    out = []
    running, kv = _gauge(level, "num_requests_running"), _gauge(level, "kv_cache_usage_perc")
    if max_num_seqs and running is not None and running >= max_num_seqs:
        out.append(f"max-num-seqs {max_num_seqs} ({running:.0f} requests ran at once)")
    if kv is not None and kv >= KV_FULL:
        out.append(f"the KV cache ({100 * kv:.0f} % used)")
    return out


def queue_note(level: LevelResult, max_num_seqs: int | None) -> str:
    """A sentence about the requests that waited in the engine's queue at the level ("" if none did),
    naming a limit only when its gauge reached it."""
    waiting = _gauge(level, "num_requests_waiting")
    if not waiting:
        return ""
    head = f"At {level.label} up to {waiting:.0f} requests waited in the engine's queue"
    if found := limits(level, max_num_seqs):
        return f"{head}: {' and '.join(found)} was the limit."
    running, kv = _gauge(level, "num_requests_running"), _gauge(level, "kv_cache_usage_perc")
    seen = []
    if running is not None:
        seen.append(f"at most {running:.0f} ran at once" + (f" of max-num-seqs {max_num_seqs}" if max_num_seqs else ""))
    if kv is not None:
        seen.append(f"the KV cache was at most {100 * kv:.0f} % used")
    return (f"{head}, with no limit reached ({', '.join(seen) or 'the engine reported no running or KV-cache gauge'}): "
            "requests sent together wait their turn to be admitted.")


def saturation_point(levels: list[LevelResult], max_num_seqs: int | None = None) -> tuple[int | None, str]:
    """(the level after which more concurrency bought no throughput, why), by the rule of saturated();
    (None, why not) for a sweep that kept scaling or has too few levels to tell."""
    done = [lv for lv in levels if lv.completed and not lv.cancelled]
    for i in range(2, len(done) + 1):
        if why := saturated(done[:i]):
            best = max(done[:i - 1], key=lambda lv: lv.output_throughput)
            found = limits(done[i - 1], max_num_seqs)
            return best.concurrency, why + (f"; {' and '.join(found)} was the limit" if found else "")
    if len(done) < 2:
        return None, "one level: nothing to compare it with"
    last, best = done[-1], max(done[:-1], key=lambda lv: lv.output_throughput)
    head = f"not saturated up to concurrency {last.concurrency}"
    if best.output_throughput <= 0 or last.output_throughput >= best.output_throughput * (1 + FLAT_GAIN):
        gain = f" {100 * (last.output_throughput / best.output_throughput - 1):.0f} %" if best.output_throughput > 0 else ""
        return None, f"{head}: output throughput still rose{gain} from concurrency {best.concurrency}"
    return None, (f"{head}: output throughput was flat from concurrency {best.concurrency}, but latency did not "
                  "climb nor the engine's queue grow")
