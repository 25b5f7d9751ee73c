"""Statistics of a tuning study (no Django): medians, bootstrap confidence intervals over repeats
and requests, differences against the baseline and a verdict per metric.

A variant's figure for one metric is a list of repeats, each a value (the repeat's output tok/s, its
median TTFT, ...) and, when known, the per-request values behind it. A bootstrap replicate picks
repeats with replacement and, inside each picked repeat, its requests with replacement; so both
host drift between repeats and request-to-request noise widen the interval.

With few repeats a percentile interval is too narrow: resampling n values sees only (n-1)/n of
their spread, and its tails are normal where a small sample's are Student's t. The interval around
the difference is widened by sqrt(n/(n-1)) * t(df)/z for that reason (n = the fewer repeats of the
two; df = n_a + n_b - 2), which keeps the false "significant" rate near 5 % at 3 repeats
(perf/study_verdicts.py measures it).

Every figure here is positive (throughputs, latencies), so intervals are made on the log scale: a variant's
interval never goes below zero, a relative difference never below -100 %, and the absolute difference's interval
is the relative one times the baseline, so both say the same direction. Each interval is placed around its point
(the mean over repeats, or the ratio of the two means) by the replicates' spread about their median, so the point
is always inside it, however skewed the replicates are. With fewer than MIN_REPEATS repeats a side there is no
interval and no verdict: too few repeats to judge (two repeats widen by Student's t at 2 degrees of freedom, 3.1
times: an interval that wide bounds nothing useful).
"""
import math
import random
import statistics
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Sequence

BETTER, WORSE, SAME, NO_VERDICT = "better", "worse", "no significant difference", "no verdict"
MIN_REPEATS = 3  # fewer repeats of a side give no interval and no verdict: too few repeats to judge
Z975 = 1.959964
# Student's t, two-sided 95 %, by degrees of freedom (1-30); beyond 30 the normal quantile is close.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# How a repeat's replicate is made from its resampled requests:
SCALED = "scaled"  # the repeat's value times mean(resampled) / mean(all)
# The repeat's value times mean(all) / mean(resampled): throughput from per-request end-to-end times (at a
# fixed concurrency, throughput goes as 1 / the mean request time). Times, not per-request rates: a rate
# divides by a request's decode time, which is near zero when a busy client reads many chunks at once.
INVERSE = "inverse"
MEAN = "mean"  # the mean of the resampled requests (tok/s per user)
MEDIAN = "median"  # the median of the resampled requests (TTFT, TPOT medians)
MAX_REQUESTS = 400  # per repeat in a replicate: more adds time, not accuracy


@dataclass
class Repeat:
    """One repeat's figure and the per-request figures behind it (empty: the value alone is resampled)."""

    value: float
    requests: Sequence[float] = field(default_factory=tuple)


@dataclass
class Estimate:
    """A variant's figure: the mean over its repeats (`value`, the point its 95 % interval holds), the median of
    its repeats beside it, and why there is no interval when there is none."""

    value: float
    median: float
    low: float | None
    high: float | None
    n: int
    why: str = ""


@dataclass
class Comparison:
    """A variant against the baseline: the difference (variant - baseline), absolute and relative, with
    95 % intervals, and the verdict for a metric where `higher_is_better` (or lower, for latencies)."""

    diff: float
    low: float
    high: float
    rel: float | None  # difference / baseline, as a fraction
    rel_low: float | None
    rel_high: float | None
    verdict: str
    why: str = ""  # why there is no verdict, when there is none


# Pocock's boundary for a two-sided 5 % test looked at K times (K = 1 to 10; Pocock 1977, Biometrika 64:191): a
# study that may stop at any of K looks once an interval decides calls a difference only beyond z_K, so that looking
# K times keeps its false calls near 5 % (each look alone at 1.96 would call one in 5 % of looks).
POCOCK_Z = (Z975, 2.178, 2.289, 2.361, 2.413, 2.453, 2.485, 2.512, 2.535, 2.555)


def sequential_z(looks: int) -> float:
    """The interval's z for a study judged at up to `looks` looks (1: the plain 95 %)."""
    return POCOCK_Z[min(max(looks, 1), len(POCOCK_Z)) - 1]


def t975(df: int) -> float:
    return T975[df - 1] if 1 <= df <= len(T975) else Z975


def t_quantile(z: float, df: int) -> float:
    """Student's t at df degrees of freedom with the normal's z's tail (the table's exact value at 1.96; else the
    Cornish-Fisher expansion in 1/df, within 0.2 % of the table from df 3, where studies judge)."""
    if z == Z975:
        return t975(df)
    t = z + (z + z ** 3) / (4 * df)
    t += (3 * z + 16 * z ** 3 + 5 * z ** 5) / (96 * df ** 2)
    t += (-15 * z + 17 * z ** 3 + 19 * z ** 5 + 3 * z ** 7) / (384 * df ** 3)
    t += (-945 * z - 1920 * z ** 3 + 1482 * z ** 5 + 776 * z ** 7 + 79 * z ** 9) / (92160 * df ** 4)
    return t


def widening(n_a: int, n_b: int, z: float = Z975) -> float:
    """How much wider than the percentile interval the reported one is (see the module's docstring)."""
    n = min(n_a, n_b)
    if n < 2:
        return 1.0
    return math.sqrt(n / (n - 1)) * t_quantile(z, n_a + n_b - 2) / z


def _replicate_repeat(repeat: Repeat, kind: str, rng: random.Random) -> float:
    reqs = repeat.requests
    if not reqs:
        return repeat.value
    if len(reqs) > MAX_REQUESTS:
        reqs = reqs[:: math.ceil(len(reqs) / MAX_REQUESTS)]
    pick = rng.choices(reqs, k=len(reqs))
    if kind == MEDIAN:
        return statistics.median(pick)
    mean = math.fsum(pick) / len(pick)
    if kind == MEAN:
        return mean
    base = math.fsum(reqs) / len(reqs)
    if kind == INVERSE:
        return repeat.value * base / mean if mean else repeat.value
    return repeat.value * mean / base if base else repeat.value


def _center(repeats: Sequence[Repeat]) -> float:
    return math.fsum(r.value for r in repeats) / len(repeats)


def replicates(repeats: Sequence[Repeat], kind: str, n_boot: int, rng: random.Random) -> list[float]:
    """Bootstrap replicates of the mean over repeats (repeats, then requests inside each, resampled)."""
    out = []
    n = len(repeats)
    for _ in range(n_boot):
        picked = [repeats[rng.randrange(n)] for _ in range(n)]
        out.append(math.fsum(_replicate_repeat(r, kind, rng) for r in picked) / n)
    return out


def quantile(sorted_values: list[float], q: float) -> float:
    rank = (len(sorted_values) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def _interval(center: float, reps: list[float], widen: float, tail: float = 0.025) -> tuple[float, float]:
    """`center` moved by the replicates' `tail` and 1 - `tail` quantiles (2.5 and 97.5 %) about their median, widened:
    holds `center`."""
    ordered = sorted(reps)
    middle = quantile(ordered, 0.5)
    return (center + widen * (quantile(ordered, tail) - middle), center + widen * (quantile(ordered, 1 - tail) - middle))


def _positive(*values: Sequence[float] | float) -> bool:
    """Every value above zero, a list's or tuple's each (the log scale takes no zero)."""
    return all(all(v > 0 for v in group) if isinstance(group, (list, tuple)) else group > 0 for group in values)


def too_few(n_b: int, n_v: int | None = None) -> str:
    """Why there is no interval or verdict with `n_b` (and `n_v`) repeats; "" when there are enough."""
    fewest = n_b if n_v is None else min(n_b, n_v)
    if fewest >= MIN_REPEATS:
        return ""
    side = "" if n_v is None else f" of {'the baseline' if n_b == fewest else 'this variant'}"
    return (f"too few repeats to judge: {fewest} repeat{'s' if fewest != 1 else ''}{side}, and an interval needs at "
            f"least {MIN_REPEATS} of each to know how much a figure varies between repeats")


def estimate(repeats: Sequence[Repeat], kind: str = SCALED, n_boot: int = 2000, seed: int = 0) -> Estimate | None:
    """The mean over the repeats with its 95 % interval (none with fewer than MIN_REPEATS repeats), and their
    median; None without repeats."""
    repeats = [r for r in repeats if r.value is not None]
    if not repeats:
        return None
    center, median = _center(repeats), statistics.median(r.value for r in repeats)
    if why := too_few(len(repeats)):
        return Estimate(value=center, median=median, low=None, high=None, n=len(repeats), why=why)
    reps = replicates(repeats, kind, n_boot, random.Random(seed))
    widen = widening(len(repeats), len(repeats))
    if _positive(center, reps):
        low, high = _interval(math.log(center), [math.log(r) for r in reps], widen)
        low, high = math.exp(low), math.exp(high)
    else:  # a zero among the figures: the plain scale, never below zero
        low, high = _interval(center, reps, widen)
        low = max(low, 0.0)
    return Estimate(value=center, median=median, low=low, high=high, n=len(repeats))


def compare(baseline: Sequence[Repeat], variant: Sequence[Repeat], kind: str = SCALED, higher_is_better: bool = True,
            n_boot: int = 2000, seed: int = 0, z: float = Z975) -> Comparison | None:
    """The variant's difference from the baseline with its 95 % interval and the verdict; None when
    either side has no repeat. The verdict is "better"/"worse" only when the interval excludes zero, and
    there is none (NO_VERDICT, and `why`) with fewer than MIN_REPEATS repeats on either side. `z` widens the
    interval to another normal quantile (sequential_z: a study that may stop at any of several looks)."""
    baseline = [r for r in baseline if r.value is not None]
    variant = [r for r in variant if r.value is not None]
    if not baseline or not variant:
        return None
    center_b, center_v = _center(baseline), _center(variant)
    diff = center_v - center_b
    rel = center_v / center_b - 1 if center_b else None
    if why := too_few(len(baseline), len(variant)):
        return Comparison(diff=diff, low=None, high=None, rel=rel, rel_low=None, rel_high=None, verdict=NO_VERDICT, why=why)
    rng = random.Random(seed)
    reps_b = replicates(baseline, kind, n_boot, rng)
    reps_v = replicates(variant, kind, n_boot, rng)
    widen, tail = widening(len(baseline), len(variant), z), 0.025 if z == Z975 else NormalDist().cdf(-z)
    if _positive(center_b, center_v, reps_b, reps_v):  # the log of the ratio: bounded below by -100 %
        low, high = _interval(math.log(center_v / center_b), [math.log(v / b) for v, b in zip(reps_v, reps_b)], widen,
                              tail)
        rel_low, rel_high = math.expm1(low), math.expm1(high)
        low, high = center_b * rel_low, center_b * rel_high
    else:
        low, high = _interval(diff, [v - b for v, b in zip(reps_v, reps_b)], widen, tail)
        rel_low, rel_high = (low / center_b, high / center_b) if center_b else (None, None)
    if low > 0:
        verdict = BETTER if higher_is_better else WORSE
    elif high < 0:
        verdict = WORSE if higher_is_better else BETTER
    else:
        verdict = SAME
    return Comparison(diff=diff, low=low, high=high, rel=rel, rel_low=rel_low, rel_high=rel_high, verdict=verdict)


def paired_ratio(ratios: Sequence[float]) -> tuple[float, float, float] | None:
    """The geometric mean of paired ratios (a over b, each pair run back to back) with its 95 % interval, Student's t
    on the log ratios: (ratio, low, high); None with fewer than MIN_REPEATS pairs or a ratio that is not positive."""
    if len(ratios) < MIN_REPEATS or not _positive(list(ratios)):
        return None
    logs = [math.log(r) for r in ratios]
    mean, half = statistics.fmean(logs), t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def pareto(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """Names of the points (name, x, y) that no other point beats on both x and y (higher is better)."""
    front = []
    for name, x, y in points:
        if not any((ox >= x and oy >= y) and (ox > x or oy > y) for _, ox, oy in points):
            front.append(name)
    return front
