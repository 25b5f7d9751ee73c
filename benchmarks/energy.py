"""Energy net of idle. Just before a run's first level the deployment's GPUs are read for PANEL_BENCH_IDLE_S (5 s) with
the engine loaded
and serving nothing (its own /metrics say so at both ends: no request running or waiting, no token generated); each
level's joules are then told both gross (what the GPUs drew over the level) and net of that idle draw (what serving
cost), per output token. A run without energy counters, or whose engine served someone else meanwhile, has no net."""
import time

from deployments.host import vllm

BUSY = "The engine served other requests while its idle draw was measured: no energy net of idle for this run."
UNREAD = "The engine's /metrics could not be read to confirm it was idle: no energy net of idle for this run."


def _activity(base_url: str, key: str) -> tuple[float, float] | None:
    """(requests running + waiting, tokens generated so far) from the engine's /metrics; None when unreadable."""
    try:
        m = vllm.read_metrics(vllm.metrics_url(base_url), key=key)
    except vllm.VllmError:
        return None
    if "num_requests_running" not in m:
        return None
    return m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0), m.get("generation_tokens_total", 0.0)


def idle_watts(meter, base_url: str, key: str, seconds: float, sleep=None) -> tuple[float | None, str]:
    """The GPUs' draw (W, all of the meter's GPUs) over `seconds` of an idle engine, and "" ; or None and why not
    ("" when the node has no energy counters: nothing to say)."""
    if not meter.supported or seconds <= 0:
        return None, ""
    before = _activity(base_url, key)
    start = meter.read()
    (sleep or time.sleep)(seconds)
    end = meter.read()
    after = _activity(base_url, key)
    joules = meter.joules(start, end)
    if joules is None or end <= start:
        return None, ""
    if before is None or after is None:
        return None, UNREAD
    if before[0] or after[0] or after[1] != before[1]:
        return None, BUSY
    return joules / (end - start), ""


def net_joules(energy_j: float | None, idle_w: float | None, duration_s: float) -> float | None:
    """A level's joules less the idle draw over its duration (never below 0: a level cannot cost less than nothing)."""
    if energy_j is None or idle_w is None:
        return None
    return max(0.0, energy_j - idle_w * duration_s)
