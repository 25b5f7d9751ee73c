"""Service-level figures of a running engine over a trailing window, from its own /metrics counters: the
time-to-first-token quantile (as Prometheus' histogram_quantile computes it from vllm:time_to_first_token_seconds)
and the share of finished requests that were aborted or failed (vllm:request_success_total by finished_reason),
the same expressions as monitoring/alerts.yml's TtftSloBreached and ErrorRateSloBreached. Plain Python."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

TTFT = "vllm:time_to_first_token_seconds"
FINISHED = "vllm:request_success_total"
FAILED_REASONS = frozenset({"abort", "error"})  # a client got no answer
ADMISSION = "vllm:admission_rejections_total"  # refused beyond --max-num-queued-reqs / -tokens (vLLM >= 0.32)
WINDOW_S = 300.0  # as the alert rules' [5m]


@dataclass(frozen=True)
class Counters:
    """One reading's cumulative counters (summed over engines and label sets)."""

    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), ascending, +Inf last
    finished: dict[str, float] = field(default_factory=dict)  # by finished_reason
    refused: float = 0.0  # admission rejections, every reason


@dataclass(frozen=True)
class Figures:
    ttft_p95_s: float | None  # None: no request got its first token in the window
    error_share: float | None  # None: no request finished in the window
    requests: int  # requests finished in the window
    span_s: float  # seconds between the window's first and last reading
    refused: int = 0  # requests the engine refused for load in the window (not among the finished)


def counters(families) -> Counters:
    """The counters from parsed metric families (prometheus_client's), or empty ones where the engine has none."""
    buckets: dict[float, float] = {}
    finished: dict[str, float] = {}
    refused = 0.0
    for family in families:
        for s in family.samples:
            if s.name == f"{TTFT}_bucket" and not math.isnan(s.value):
                le = float(s.labels.get("le", "inf"))
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == FINISHED and not math.isnan(s.value):
                reason = s.labels.get("finished_reason", "")
                finished[reason] = finished.get(reason, 0.0) + s.value
            elif s.name == ADMISSION and not math.isnan(s.value):
                refused += s.value
    return Counters(tuple(sorted(buckets.items())), finished, refused)


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear within the bucket that
    holds the rank; the highest finite bound when the rank falls in +Inf; None without observations."""
    if not buckets or not math.isinf(buckets[-1][0]) or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    below_le, below_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return below_le
            if count == below_count:
                return le
            start = below_le if below_le > 0 or le <= 0 else 0.0
            return start + (le - start) * (rank - below_count) / (count - below_count)
        below_le, below_count = le, count
    return below_le


def _delta(new: Counters, old: Counters) -> Counters | None:
    """new - old, or None where a counter fell (the engine restarted: the window starts again)."""
    old_buckets = dict(old.ttft_buckets)
    buckets = tuple((le, count - old_buckets.get(le, 0.0)) for le, count in new.ttft_buckets)
    finished = {reason: count - old.finished.get(reason, 0.0) for reason, count in new.finished.items()}
    if any(c < 0 for _, c in buckets) or any(c < 0 for c in finished.values()) or set(old.finished) - set(new.finished):
        return None
    if new.refused < old.refused:
        return None
    return Counters(buckets, finished, new.refused - old.refused)


class Window:
    """Readings of one engine over the trailing `seconds`; `figures()` compares the newest with the oldest."""

    def __init__(self, seconds: float = WINDOW_S):
        self.seconds = seconds
        self.readings: deque[tuple[float, Counters]] = deque()

    def add(self, t: float, reading: Counters) -> None:
        if self.readings and _delta(reading, self.readings[-1][1]) is None:
            self.readings.clear()  # a counter fell: a new engine process, a new window
        self.readings.append((t, reading))
        while len(self.readings) > 2 and self.readings[1][0] <= t - self.seconds:
            self.readings.popleft()  # keep one reading at or before the window's start

    def figures(self, q: float = 0.95) -> Figures:
        if len(self.readings) < 2:
            return Figures(None, None, 0, 0.0)
        (t0, first), (t1, last) = self.readings[0], self.readings[-1]
        delta = _delta(last, first)
        if delta is None:  # cannot happen after add(); kept for a caller that built readings by hand
            return Figures(None, None, 0, t1 - t0)
        done = sum(delta.finished.values())
        failed = sum(c for reason, c in delta.finished.items() if reason in FAILED_REASONS)
        return Figures(quantile(q, delta.ttft_buckets), failed / done if done > 0 else None, int(round(done)), t1 - t0,
                       int(round(delta.refused)))
