"""A study's winner at each concurrency level and each request rate, and where the winner changes (no Django
queries).

A level is named by its concurrency (16, shown "c=16") or by its rate ("4/s", shown "4 req/s"), as
/metrics names them; `apply` takes either name. Rates are judged apart from concurrencies: each kind has
its own winners and its own crossover sentence.

Each level's winner follows the study's throughput rule at that level (studyresults.choose_winner: a
variant wins only when significantly better than the baseline there, else the baseline stays). Where
two neighbouring levels have different winners the study names a crossover ("A below c=32, B from
c=32") only when the intervals support it: at the lower level the first winner is significantly
better than the second, and at the higher level the second significantly better than the first, by
the same bootstrap comparison (benchmarks.studystats) the verdicts use. Otherwise it says the measured
best differs but the intervals cannot tell the two apart there.
"""
from benchmarks import studystats


def _key(level) -> str:
    return f"throughput@{level}"


def rate_name(rate: float) -> str:
    """A rate level's name: "4/s", "0.5/s"."""
    return f"{float(rate):g}/s"


def point_level(kind: str, concurrency: int, rate: float):
    """A point's level: its concurrency (an int), or its rate's name."""
    return rate_name(rate) if kind == "rate" else int(concurrency)


def parse_level(value):
    """A level from what a user gave: 16, "16", "c=16" (a concurrency), "4/s", "4 req/s" (a rate); None if
    it is neither."""
    text = str(value).strip().lower().replace(" ", "")
    text = text[2:] if text.startswith("c=") else text
    if text.isdigit() and len(text) < 10:
        return int(text)
    for tail in ("req/s", "/s"):
        if text.endswith(tail):
            try:
                rate = float(text[: -len(tail)])
            except ValueError:
                return None
            return rate_name(rate) if 0 < rate < float("inf") else None
    return None


def label(level) -> str:
    """How a sentence shows a level: "c=16" or "4 req/s"."""
    return f"{level[:-2]} req/s" if isinstance(level, str) else f"c={level}"


def _bare(level) -> str:
    """The number of a level's name: "16", "4"."""
    return level[:-2] if isinstance(level, str) else str(level)


def study_levels(workload: dict) -> list:
    """A study's levels: its concurrencies, then its rates by name."""
    return [int(c) for c in workload.get("levels") or []] + [rate_name(r) for r in sorted(workload.get("rates") or [])]


def _order(level) -> float:
    return float(level[:-2]) if isinstance(level, str) else float(level)


def level_winners(rows: list[dict], repeats: dict, levels: list, choose, n_boot: int = 2000,
                  z: float = studystats.Z975) -> dict:
    """{"levels": [{"level", "kind", "label", "winner", "name", "why"}], "crossover": sentence(s) or "", "note":
    why none is named}: concurrencies first, then rates, each kind with its own crossover.
    `choose(rows, rule, levels)` is studyresults.choose_winner; `repeats` is variant id -> key -> repeats."""
    out = {"levels": [], "crossover": "", "note": ""}
    for kind in ("concurrency", "rate"):
        mine = sorted((lv for lv in levels if isinstance(lv, str) == (kind == "rate")), key=_order)
        if mine:
            part = _winners(rows, repeats, mine, levels, choose, n_boot, z)
            out["levels"] += [{**item, "kind": kind} for item in part["levels"]]
            out["crossover"] = " ".join(x for x in (out["crossover"], part["crossover"]) if x)
            out["note"] = " ".join(x for x in (out["note"], part["note"]) if x)
    return out


def _winners(rows: list[dict], repeats: dict, mine: list, levels: list, choose, n_boot: int, z: float) -> dict:
    """level_winners for the levels of one kind (`mine`, in order)."""
    names = {r["id"]: r["name"] for r in rows}
    per_level = []
    for level in mine:
        winner, why = choose(rows, {"kind": "throughput", "level": level}, levels)
        per_level.append({"level": level, "label": label(level), "winner": winner, "name": names.get(winner, ""),
                          "why": why})
    segments = []  # [(winner, first level, last level)]
    for item in per_level:
        if item["winner"] is None:
            continue
        if segments and segments[-1][0] == item["winner"]:
            segments[-1][2] = item["level"]
        else:
            segments.append([item["winner"], item["level"], item["level"]])
    out = {"levels": per_level, "crossover": "", "note": ""}
    if len(segments) < 2:
        return out
    unsupported = []
    for (a, _, a_last), (b, b_first, _) in zip(segments, segments[1:]):
        if not (_better(repeats, a, b, a_last, n_boot, z) and _better(repeats, b, a, b_first, n_boot, z)):
            unsupported.append(f"{names[a]} at {label(a_last)} and {names[b]} at {label(b_first)}")
    if unsupported:
        out["note"] = ("The variant measured best changes with the load, but the intervals do not separate "
                       f"{'; '.join(unsupported)}: no crossover is claimed.")
        return out
    parts = []
    for i, (winner, first, last) in enumerate(segments):
        if i == 0:
            parts.append(f"{names[winner]} below {label(segments[1][1])}")
        elif i == len(segments) - 1:
            parts.append(f"{names[winner]} from {label(first)}")
        else:
            span = label(first) if last == first else label(first).replace(_bare(first), f"{_bare(first)}-{_bare(last)}")
            parts.append(f"{names[winner]} at {span}")
    what = "rate" if isinstance(mine[0], str) else "load"
    out["crossover"] = f"The winner changes with the {what}: " + ", ".join(parts) + "."
    return out


def _better(repeats: dict, winner: int, other: int, level: int, n_boot: int, z: float) -> bool:
    """Whether `winner`'s output tok/s at the level is significantly above `other`'s."""
    mine, theirs = repeats.get(winner, {}).get(_key(level)), repeats.get(other, {}).get(_key(level))
    if not mine or not theirs:
        return False
    comparison = studystats.compare(theirs, mine, studystats.INVERSE, True, n_boot=n_boot, z=z)
    return comparison is not None and comparison.verdict == studystats.BETTER


def winner_at(results: dict, level) -> int | None:
    """The variant id that wins at a level (a concurrency, or a rate by any name parse_level reads), from a
    study's stored results (None: no such level or no winner)."""
    level = parse_level(level)
    for item in (results or {}).get("per_level", {}).get("levels", []):
        if level is not None and parse_level(item["level"]) == level:
            return item["winner"]
    return None
