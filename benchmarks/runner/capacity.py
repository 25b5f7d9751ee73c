"""A capacity search: the highest request rate whose levels still meet the SLOs, by bisection (no Django).

    spec = LoadSpec(..., levels=(), slos=[{"metric": "ttft", "percentile": 99, "max_ms": 2000}],
                    capacity={"low": 1, "high": 64, "width": 2, "repeats": 2})
    result = sweep(spec)  # result.capacity: {"rate": 23.5, "low": 23.5, "high": 25.5, "rounds": [...], "text": ...}

Each round measures the middle of the interval [low, high] as a rate level, `repeats` times with a
different arrival seed each; the rate passes when every repeat met every SLO (one bad repeat is
enough to doubt a rate a deployment is to be sold at). A pass moves `low` up, a miss `high` down; the
search stops once high - low <= width, so it takes ceil(log2((high - low) / width)) rounds. `low` is
taken to pass and `high` to miss without being measured: the answer is the highest rate measured to
pass, or none when every round missed ("below ...").
"""
import math

import benchmarks.runner.slo as slos_mod  # the module, not the package (its __init__ imports this one)
from .spec import RunnerError

MAX_ROUNDS = 12
MAX_REPEATS = 5


def rounds_needed(low: float, high: float, width: float) -> int:
    return max(0, math.ceil(math.log2((high - low) / width))) if high > low and width > 0 else 0


def check(capacity: dict) -> dict:
    """The search's settings checked and normalised; raises RunnerError (permanent) saying what is wrong."""
    try:
        low, high = float(capacity["low"]), float(capacity["high"])
        width, repeats = float(capacity.get("width") or 0), int(capacity.get("repeats") or 1)
    except (KeyError, TypeError, ValueError):
        raise RunnerError("A capacity search needs low and high request rates (req/s) and a width.", permanent=True) from None
    if not 0 <= low < high:
        raise RunnerError(f"A capacity search's low rate is below its high one and not negative (got {low:g}-{high:g}).",
                          permanent=True)
    if not width > 0:
        width = (high - low) / 2 ** 6
    if not 1 <= repeats <= MAX_REPEATS:
        raise RunnerError(f"A capacity search repeats each rate 1 to {MAX_REPEATS} times (got {repeats}).", permanent=True)
    if rounds_needed(low, high, width) > MAX_ROUNDS:
        raise RunnerError(f"{low:g}-{high:g} req/s to within {width:g} takes {rounds_needed(low, high, width)} rounds; "
                          f"at most {MAX_ROUNDS}: give a wider width or a narrower range.", permanent=True)
    return {"low": low, "high": high, "width": width, "repeats": repeats}


def search(measure, slos: list[dict], capacity: dict, cancelled=lambda: False) -> dict:
    """Bisect with `measure(rate, repeat) -> LevelResult` (its `slo` filled in); the result as sweep() reports it."""
    settings = check(capacity)
    low, high, width = settings["low"], settings["high"], settings["width"]
    rounds, best = [], None
    while high - low > width and not cancelled():
        rate = round((low + high) / 2, 4)
        levels = []
        for repeat in range(settings["repeats"]):
            level = measure(rate, repeat)
            levels.append(level)
            if level.cancelled or not (level.slo or {}).get("met"):
                break  # a miss decides the round; more repeats cannot make it pass
        if any(level.cancelled for level in levels):
            break
        passed = len(levels) == settings["repeats"] and all(lv.slo.get("met") for lv in levels)
        rounds.append({"rate": rate, "met": passed, "repeats": [
            {"goodput": round(lv.slo.get("goodput", 0.0), 4), "attainment_pct": lv.slo.get("attainment_pct"),
             "achieved_rate": round(lv.achieved_rate, 4)} for lv in levels]})
        if passed:
            low, best = rate, rate
        else:
            high = rate
    result = {"rate": best, "low": low, "high": high, "width": width, "repeats": settings["repeats"],
              "searched": [settings["low"], settings["high"]], "rounds": rounds, "converged": high - low <= width,
              "slos": slos}
    result["text"] = text(result)
    return result


def _rate(value: float) -> str:
    return f"{round(value, 2):g}"


def text(result: dict, subject: str = "This deployment") -> str:
    """The answer in words: "This deployment serves 23.5 req/s at p99 TTFT <= 2 s (within 2 req/s; 6 rounds)."."""
    slo_text = slos_mod.describe(result.get("slos") or [])
    rounds = len(result.get("rounds") or [])
    how = f"searched {result['searched'][0]:g}-{result['searched'][1]:g} req/s, {rounds} round{'s' * (rounds != 1)}"
    if not result.get("converged"):
        how += ", stopped before the interval reached its width"
    if result.get("rate") is None:
        return f"{subject} serves less than {_rate(result['high'])} req/s at {slo_text}: no rate measured met it ({how})."
    if all(r["met"] for r in result.get("rounds") or []):
        return (f"{subject} serves at least {_rate(result['rate'])} req/s at {slo_text}: every rate measured met it, "
                f"so the limit may lie above the range ({how}).")
    return (f"{subject} serves {_rate(result['rate'])} req/s at {slo_text} "
            f"(the limit lies below {_rate(result['high'])} req/s; {how}).")
