"""When each request of an open-loop (rate) level is due: seeded Poisson or gamma arrivals, optionally
ramped (no Django).

As `vllm bench serve --request-rate R --burstiness B`: the gaps between requests are drawn from a gamma
distribution of shape B and mean 1/R, so B = 1 is a Poisson process, B < 1 burstier, B > 1 more even. A
ramp moves the rate from `ramp_from` to the level's rate over its requests, linearly or geometrically,
each gap drawn at the rate of the request before it. The draw is seeded by (spec.seed, rate): the same
spec sends the same schedule, so a run is reproducible and a test can check the schedule itself.
A level's warm-up (rate_warmup) goes first, at the level's starting rate from its own seed, so the
measured schedule is the same with or without it.
"""
import math
import random

ARRIVALS = ("poisson", "gamma")
RAMPS = ("", "linear", "exponential")


def shape(spec) -> float:
    """The gamma shape of the gaps: 1 for Poisson, the burstiness for gamma arrivals."""
    return float(spec.burstiness) if spec.arrival == "gamma" else 1.0


def rate_at(spec, rate: float, i: int, n: int) -> float:
    """Requests/s when request i of n is sent: the level's rate, or on its ramp from spec.ramp_from."""
    if not spec.ramp or n < 2:
        return rate
    progress = i / (n - 1)
    if spec.ramp == "linear":
        return spec.ramp_from + (rate - spec.ramp_from) * progress
    return spec.ramp_from * (rate / spec.ramp_from) ** progress


def rate_requests(spec, rate: float) -> int:
    """Requests of a rate level: max(min_requests, rate × rate_duration_s)."""
    return max(spec.min_requests, math.ceil(rate * spec.rate_duration_s))


def due_offsets(spec, rate: float, n: int) -> list[float]:
    """Seconds from the level's start at which each of its n requests is due: the first at 0, then
    one seeded gamma gap after another."""
    rng = random.Random(f"{spec.seed}/rate/{rate!r}")
    k = shape(spec)
    out, t = [], 0.0
    for i in range(n):
        out.append(t)
        t += rng.gammavariate(k, 1.0 / (k * rate_at(spec, rate, i, n)))
    return out


def rate_warmup(spec, rate: float, measured: int) -> int:
    """Warm-up arrivals of a rate level of `measured` arrivals: warmup_per_user seconds of its schedule (⌈rate⌉
    a second), never more than the level measures; sent before the measured ones and left out of the level's
    figures, as a concurrency level's warm-up is."""
    return min(measured, max(0, spec.warmup_per_user) * math.ceil(rate))


def with_warmup(spec, rate: float, due: list[float], warmup: int) -> list[float]:
    """`warmup` due times at the level's starting rate (gaps drawn as due_offsets draws them, from their
    own seed), then the measured `due` shifted to start one more such gap after the last of them."""
    if not warmup:
        return due
    rng = random.Random(f"{spec.seed}/warmup/{rate!r}")
    k, start_rate = shape(spec), rate_at(spec, rate, 0, len(due) or 1)
    warm, t = [], 0.0
    for _ in range(warmup):
        warm.append(t)
        t += rng.gammavariate(k, 1.0 / (k * start_rate))
    return warm + [t + d for d in due]
