"""When a sweep may stop: the engine is saturated once more concurrency buys no throughput (no Django).

Saturated after a level when its output throughput gained less than FLAT_GAIN over the best level
before it, and either the median end-to-end latency rose by LATENCY_RISE over the previous level or
the engine's waiting queue (vllm:num_requests_waiting, when scraped) grew. Higher levels would only
measure queueing, at the price of minutes on a small box.
"""
from .spec import LevelResult

FLAT_GAIN = 0.10  # throughput within 10 % of the best so far is flat
LATENCY_RISE = 0.25  # median E2E up 25 % on the previous level is climbing


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
