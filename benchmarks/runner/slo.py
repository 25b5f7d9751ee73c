"""Service-level objectives of a run and what each level met of them: goodput and attainment (no Django).

An SLO is {"metric": "ttft" | "itl" | "e2e", "percentile": 99, "max_ms": 2000}: "p99 TTFT <= 2 s". A
request meets it when its own figure is within max_ms: its TTFT, its end-to-end time, or (ITL) its own
per-token gaps at that percentile (chunks that arrived in one read share their gap, as stats.py counts
them; a request with no decode gap meets it). A failed request meets none. A level holds an SLO when
at least `percentile` % of its measured requests meet it, so "p99 TTFT <= 2 s" holds exactly when 99 %
of the requests had their first token within 2 s. Goodput is the requests meeting every SLO per second
of the level (first send to last completion), attainment the share of them (as vllm bench serve's
--goodput counts requests meeting every threshold).
"""
import re

from .spec import RequestRecord, RunnerError
from .stats import arrivals, chunk_token_counts, per_token_gaps, percentile

METRICS = {"ttft": "TTFT", "itl": "ITL", "e2e": "E2E"}
MAX_SLOS = 6
_SLO = re.compile(r"^\s*(ttft|itl|e2e)\s*[:\s]\s*p?(\d+(?:\.\d+)?)\s*[:\s]\s*(?:<=\s*)?(\d+(?:\.\d+)?)\s*(ms|s)?\s*$", re.I)


class SloError(RunnerError):
    """An SLO that cannot be read; the message shows the expected form."""

    PERMANENT = True


def parse(text: str) -> list[dict]:
    """'ttft:p99:2s, itl:p95:50ms' (or 'ttft p99 2000') -> SLO dicts; milliseconds unless 's' is given; '' -> []."""
    slos = []
    for part in (p for p in re.split(r"[,;\n]", text or "") if p.strip()):
        m = _SLO.match(part)
        if not m:
            raise SloError(f"Cannot read the SLO {part.strip()!r}: write metric:percentile:limit, e.g. "
                           "ttft:p99:2s or itl:p95:50ms (metrics: ttft, itl, e2e).", permanent=True)
        limit = float(m[3]) * (1000.0 if (m[4] or "ms").lower() == "s" else 1.0)
        slos.append({"metric": m[1].lower(), "percentile": float(m[2]), "max_ms": limit})
    return validate(slos)


def validate(slos: list[dict]) -> list[dict]:
    """The SLOs checked and normalised (metric known, percentile in (0, 100], limit above 0, at most MAX_SLOS)."""
    if slos and not isinstance(slos, (list, tuple)):
        raise SloError("SLOs are a list of {metric, percentile, max_ms}, or text like ttft:p99:2s.", permanent=True)
    out = []
    for slo in slos or []:
        try:
            metric, pct, limit = str(slo["metric"]).lower(), float(slo["percentile"]), float(slo["max_ms"])
        except (KeyError, TypeError, ValueError):
            raise SloError(f"An SLO is {{metric, percentile, max_ms}}; got {slo!r}.", permanent=True) from None
        if metric not in METRICS:
            raise SloError(f"An SLO's metric is one of {', '.join(METRICS)} (got {metric!r}).", permanent=True)
        if not 0 < pct <= 100:
            raise SloError(f"An SLO's percentile is above 0 and at most 100 (got {pct:g}).", permanent=True)
        if not 0 < limit <= 86_400_000:
            raise SloError(f"An SLO's limit is milliseconds above 0 (got {limit:g}).", permanent=True)
        out.append({"metric": metric, "percentile": pct, "max_ms": limit})
    if len(out) > MAX_SLOS:
        raise SloError(f"Give at most {MAX_SLOS} SLOs.", permanent=True)
    return out


def _ms(value_ms: float) -> str:
    return f"{value_ms / 1000:g} s" if value_ms >= 1000 and value_ms % 100 == 0 else f"{value_ms:g} ms"


def describe(slos: list[dict]) -> str:
    """'p99 TTFT <= 2 s and p95 ITL <= 50 ms'."""
    return " and ".join(f"p{s['percentile']:g} {METRICS[s['metric']]} <= {_ms(s['max_ms'])}" for s in slos)


def request_value_ms(record: RequestRecord, slo: dict) -> float | None:
    """The request's figure for the SLO in ms; None when it has none (failed; ITL without a decode gap: 0)."""
    if not record.success or not record.chunk_times:
        return None
    if slo["metric"] == "ttft":
        return record.ttft * 1000.0
    if slo["metric"] == "e2e":
        return record.e2e * 1000.0
    gaps = sorted(per_token_gaps(arrivals(record, chunk_token_counts(record)[0])))
    return percentile(gaps, slo["percentile"]) * 1000.0 if gaps else 0.0


def evaluate(records: list[RequestRecord], slos: list[dict], duration_s: float) -> dict:
    """What a level's measured requests met: {"good", "goodput", "attainment_pct", "met", "each": [{metric,
    percentile, max_ms, met_pct, holds, value_ms (the level's own percentile of the metric)}]}; {} without SLOs."""
    if not slos:
        return {}
    n = len(records)
    good = [True] * n
    each = []
    for slo in slos:
        values = [request_value_ms(r, slo) for r in records]
        within = [v is not None and v <= slo["max_ms"] for v in values]
        good = [g and w for g, w in zip(good, within)]
        met = sum(within)
        seen = sorted(v for v in values if v is not None)
        # Holds when at least percentile % met it; compared in integers of hundredths so 99 of 100 holds p99.
        holds = n > 0 and met * 10_000 >= round(slo["percentile"] * 100) * n
        each.append({**slo, "met_pct": round(100.0 * met / n, 3) if n else 0.0, "holds": holds,
                     "value_ms": round(percentile(seen, slo["percentile"]), 3) if seen else None})
    count = sum(good)
    return {"good": count, "goodput": count / duration_s if duration_s > 0 else 0.0,
            "attainment_pct": round(100.0 * count / n, 3) if n else 0.0,
            "met": all(e["holds"] for e in each), "each": each}
