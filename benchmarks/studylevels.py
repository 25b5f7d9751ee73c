"""A study's winner at each concurrency level, and where the winner changes (no Django queries).

Each level's winner follows the study's throughput rule at that level (studyresults.choose_winner: a
variant wins only when significantly better than the baseline there, else the baseline stays). Where
two neighbouring levels have different winners the study names a crossover ("A below c=32, B from
c=32") only when the intervals support it: at the lower level the first winner is significantly
better than the second, and at the higher level the second significantly better than the first, by
the same bootstrap comparison (benchmarks.tunestats) the verdicts use. Otherwise it says the measured
best differs but the intervals cannot tell the two apart there.
"""
from benchmarks import tunestats


def _key(level: int) -> str:
    return f"throughput@{level}"


def level_winners(rows: list[dict], repeats: dict, levels: list[int], choose, n_boot: int = 2000) -> dict:
    """{"levels": [{"level", "winner", "name", "why"}], "crossover": sentence or "", "note": why none is named}.
    `choose(rows, rule, levels)` is studyresults.choose_winner; `repeats` is variant id -> key -> repeats."""
    names = {r["id"]: r["name"] for r in rows}
    per_level = []
    for level in sorted(levels):
        winner, why = choose(rows, {"kind": "throughput", "level": level}, levels)
        per_level.append({"level": level, "winner": winner, "name": names.get(winner, ""), "why": why})
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
        if not (_better(repeats, a, b, a_last, n_boot) and _better(repeats, b, a, b_first, n_boot)):
            unsupported.append(f"{names[a]} at c={a_last} and {names[b]} at c={b_first}")
    if unsupported:
        out["note"] = ("The variant measured best changes with the load, but the intervals do not separate "
                       f"{'; '.join(unsupported)}: no crossover is claimed.")
        return out
    parts = []
    for i, (winner, first, last) in enumerate(segments):
        if i == 0:
            parts.append(f"{names[winner]} below c={segments[1][1]}")
        elif i == len(segments) - 1:
            parts.append(f"{names[winner]} from c={first}")
        else:
            parts.append(f"{names[winner]} at c={first}" + (f"-{last}" if last != first else ""))
    out["crossover"] = "The winner changes with the load: " + ", ".join(parts) + "."
    return out


def _better(repeats: dict, winner: int, other: int, level: int, n_boot: int) -> bool:
    """Whether `winner`'s output tok/s at the level is significantly above `other`'s."""
    mine, theirs = repeats.get(winner, {}).get(_key(level)), repeats.get(other, {}).get(_key(level))
    if not mine or not theirs:
        return False
    comparison = tunestats.compare(theirs, mine, tunestats.INVERSE, True, n_boot=n_boot)
    return comparison is not None and comparison.verdict == tunestats.BETTER


def winner_at(results: dict, level: int) -> int | None:
    """The variant id that wins at a level, from a study's stored results (None: no such level or no winner)."""
    for item in (results or {}).get("per_level", {}).get("levels", []):
        if item["level"] == level:
            return item["winner"]
    return None
