"""Noise called out: what a difference between compared runs is worth, and when a run's own load generator could not
keep its schedule.

Compared runs are one run each: a difference between them holds the host's drift between the runs, which one run
cannot measure (a tuning study's repeats do). What one run can say is its own spread: its requests resampled
(benchmarks/studystats.replicates over the level's per-request samples). A difference inside that spread is "within
noise"; one beyond it may still be drift, and the page says so.

A rate level (and a capacity search) is only the load it asked for when its requests were sent on time: a load
generator whose sends lag (its host busy) offers less than the rate it names, so what the engine served there is a
lower bound of what it can serve, and the run page says so above its figures."""
from __future__ import annotations

import math
import random

from benchmarks import studystats

# (label, the point's figure, the per-request samples behind it, how a replicate is made of them, higher is better)
METRICS = (
    ("output tok/s", lambda p: p.output_throughput, "e2e_ms", studystats.INVERSE, True),
    ("TTFT median (ms)", lambda p: (p.ttft_ms or {}).get("median"), "ttft_ms", studystats.MEDIAN, False),
    ("tok/s per user", lambda p: p.tok_s_per_user, "tok_s", studystats.MEAN, True),
)
N_BOOT = 400
LAG_SHARE = 0.1  # a send lag p99 over this share of the mean gap between requests, or of an SLO's limit


def _spread(value: float, samples: list[float], kind: str, rng: random.Random) -> list[float]:
    """Replicates of one level's figure, its requests resampled (the value alone when it kept none)."""
    return studystats.replicates([studystats.Repeat(value, tuple(samples or ()))], kind, N_BOOT, rng)


def level_deltas(runs) -> list[dict]:
    """Each later run against the first, level by shared concurrency level and metric: the relative difference and
    whether it is within the two runs' own spread (the 95 % interval of the log ratio, requests resampled)."""
    if len(runs) < 2:
        return []
    def firsts(run) -> dict:  # first measurements only: repeats are compared over their repeats (benchmarks.runrepeats)
        return {p.concurrency: p for p in run.points.all() if p.kind == "concurrency" and not p.repeat}

    base = firsts(runs[0])
    rows = []
    for run in runs[1:]:
        for c, p in sorted((c, p) for c, p in firsts(run).items() if c in base):
            rows += [row for metric in METRICS if (row := _delta(run, base[c], p, *metric))]
    return rows


def _delta(run, b, p, label: str, figure, key: str, kind: str, higher: bool) -> dict | None:
    """One metric of one level: `p` (of `run`) against `b`, the first run's; None when either has no figure."""
    then, now = figure(b), figure(p)
    if not then or not now:
        return None
    rng = random.Random(p.concurrency)
    reps_b = _spread(then, (b.samples or {}).get(key), kind, rng)
    reps_v = _spread(now, (p.samples or {}).get(key), kind, rng)
    logs = sorted(math.log(v / w) for v, w in zip(reps_v, reps_b) if v > 0 and w > 0)
    noise = not logs or studystats.quantile(logs, 0.025) <= 0 <= studystats.quantile(logs, 0.975)
    rel = now / then - 1
    return {"run": run, "level": p.concurrency, "metric": label, "base": then, "value": now, "rel": rel,
            "rel_text": f"{rel * 100:+.1f} %", "noise": noise,
            "verdict": "within noise" if noise else f"{'better' if (now > then) == higher else 'worse'}, beyond the runs' own spread"}


def late_sends(run, points) -> str:
    """A sentence when the load generator sent a rate level's requests late (p99 lag over LAG_SHARE of the mean gap
    between requests, or of an SLO's limit): those levels offered less load than they name; "" when none did."""
    limits = [float(s["max_ms"]) for s in (run.params.get("slos") or []) if s.get("max_ms")]
    late = []
    for p in points:
        lag = (p.lag_ms or {}).get("p99") or 0.0
        if p.kind != "rate" or not p.rate or not lag:
            continue
        gap = 1000.0 / p.rate
        bound = min([LAG_SHARE * gap, *(LAG_SHARE * ms for ms in limits)])
        if lag > bound:
            late.append((p, lag, gap))
    if not late:
        return ""
    worst = max(late, key=lambda x: x[1])
    levels = ", ".join(f"{p.rate:g} req/s" for p, _, _ in late[:6]) + (" and more" if len(late) > 6 else "")
    return (f"The load generator sent late at {levels}: send lag p99 up to {worst[1]:,.0f} ms against a mean gap of "
            f"{worst[2]:,.0f} ms between requests (more than {LAG_SHARE:.0%} of it"
            + (" or of an SLO's limit" if limits else "") + "). Those levels offered less load than they name, so what "
            "the engine served there is a lower bound; its host was busy (see the Lag column).")
