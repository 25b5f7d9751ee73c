"""A plain run's repeats: each level's figures as the median of its repeats with a 95 % interval, and two runs
compared level by level, a difference marked only where their intervals separate.

The statistics are a study's (benchmarks.studystats, the same figures as benchmarks.studyresults.METRICS): a
repeat's figure with its per-request figures behind it, bootstrapped over repeats and requests, widened by
Student's t for few repeats, and no interval nor verdict with fewer than studystats.MIN_REPEATS repeats. That takes
seconds a level, so a run's figures are worked out once as it ends (run.over_repeats) and comparisons read them."""
from benchmarks import studylevels, studystats
from benchmarks.models import BenchmarkPoint, BenchmarkRun
from benchmarks.studyresults import METRICS


LABELS = [label for label, *_ in METRICS.values()]  # the figures' column heads, in order


def _level(p: BenchmarkPoint):
    return studylevels.point_level(p.kind, p.concurrency, p.rate)


def repeats_of(points) -> dict:
    """level -> metric -> its repeats (studystats.Repeat), in the order the levels ran."""
    out: dict = {}
    for p in sorted(points, key=lambda p: (p.kind, p.rate, p.concurrency, p.repeat)):
        figures = out.setdefault(_level(p), {})
        for metric, (_, _, _, value, samples) in METRICS.items():
            if (v := value(p)) is not None:
                reqs = tuple((p.samples or {}).get(samples) or ()) if samples else ()
                figures.setdefault(metric, []).append(studystats.Repeat(float(v), reqs))
    return out


def _figure(estimate: studystats.Estimate) -> dict:
    return {"median": estimate.median, "mean": estimate.value, "low": estimate.low, "high": estimate.high,
            "repeats": estimate.n, "why": estimate.why}


def run_repeats(run: BenchmarkRun) -> list[dict]:
    """Each level measured more than once: {"level", "label", "repeats", "figures": {metric: {"label", "median",
    "mean", "low", "high", "repeats", "why"} or None, every metric of METRICS in its order}}; [] for a run of one
    measurement a level (its levels table says it all). A capacity search's repeats are its own (run.capacity)."""
    if (run.params or {}).get("repeats", 1) <= 1:
        return []
    out = []
    for level, figures in repeats_of(run.points.all()).items():
        n = max(len(r) for r in figures.values())
        if n < 2:
            continue
        shown = {}
        for metric, (label, kind, _, _, _) in METRICS.items():  # every metric, in one order: None where none measured
            e = studystats.estimate(figures.get(metric, []), kind)
            shown[metric] = {"label": label, **_figure(e)} if e else None
        out.append({"level": level, "label": studylevels.label(level), "repeats": n, "figures": shown})
    return out


def compare_runs(a: BenchmarkRun, b: BenchmarkRun) -> list[dict]:
    """Run b against run a at each level both measured more than once, from their stored figures (run.over_repeats):
    per metric both figures ("pair": a's, b's), b's median against a's ("rel") and the verdict. A difference is marked
    "better" or "worse" only where the two 95 % intervals separate, "no significant difference" where they overlap, and "no
    verdict" (with why) where either run has no interval: under 3 repeats."""
    mine = {row["label"]: row["figures"] for row in a.over_repeats or []}
    out = []
    for row in b.over_repeats or []:
        if (theirs := mine.get(row["label"])) is None:
            continue
        metrics = {}
        for metric, (label, _, higher, _, _) in METRICS.items():
            then, now = theirs.get(metric), row["figures"].get(metric)
            if then and now:
                metrics[metric] = {"label": label, "pair": [then, now], **_verdict(then, now, higher)}
        if metrics:
            out.append({"level": row["level"], "label": row["label"], "metrics": metrics})
    return out


def compared_to_first(runs: list[BenchmarkRun]) -> list[dict]:
    """Each later run against the first (compare_runs), each row naming its run: the compare page's and API's."""
    return [{"run": r, **row} for r in runs[1:] for row in compare_runs(runs[0], r)]


def _verdict(then: dict, now: dict, higher: bool) -> dict:
    rel = now["median"] / then["median"] - 1 if then["median"] else None
    if then["low"] is None or now["low"] is None:
        why = then["why"] or now["why"]
        return {"rel": rel, "verdict": studystats.NO_VERDICT, "why": why}
    if now["low"] > then["high"]:
        verdict = studystats.BETTER if higher else studystats.WORSE
    elif now["high"] < then["low"]:
        verdict = studystats.WORSE if higher else studystats.BETTER
    else:
        verdict = studystats.SAME
    return {"rel": rel, "verdict": verdict, "why": ""}
