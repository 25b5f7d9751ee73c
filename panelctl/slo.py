"""panelctl bench: SLOs (--slo ttft:p99:2s), each level's goodput, and a capacity search (--capacity 1-64)."""
from panelctl.client import BAD_INPUT, CliError


def slo_arguments(s) -> None:
    s.add_argument("--slo", action="append", default=[], help="an SLO as metric:percentile:limit, e.g. ttft:p99:2s or "
                   "itl:p95:50ms (metrics ttft, itl, e2e); repeat or separate with commas; each level then reports "
                   "its goodput")
    s.add_argument("--capacity", default="", help="search LOW-HIGH req/s, e.g. 1-64, for the highest rate meeting the "
                   "SLOs (bisection)")
    s.add_argument("--capacity-width", type=float, default=0.0, help="stop once the interval is this narrow "
                   "(req/s; 0: a 64th of the range)")
    s.add_argument("--capacity-repeats", type=int, default=1, help="runs of each rate; it passes when all meet the SLOs")


def slo_body(args) -> dict:
    """The run's SLO and capacity fields ({} without --slo); the panel checks the values and says what is wrong."""
    body = {}
    slos = ", ".join(getattr(args, "slo", None) or [])
    if slos:
        body["slos"] = slos
    text = getattr(args, "capacity", "") or ""
    if text:
        try:
            low, high = (float(x) for x in text.split("-", 1))
        except ValueError:
            raise CliError(f"--capacity takes LOW-HIGH requests per second, e.g. 1-64 (got {text!r})", BAD_INPUT) from None
        body["capacity"] = {"low": low, "high": high, "width": args.capacity_width, "repeats": args.capacity_repeats}
    return body


def asked(params: dict, rest: str) -> str:
    """What a run measures, the capacity search included: "concurrency 1, 8; capacity search 1-64 req/s"."""
    search = params.get("capacity")
    more = f"capacity search {search['low']:g}-{search['high']:g} req/s" if search else ""
    return "; ".join(x for x in (rest, more) if x)


def slo_line(p: dict) -> str:
    """A level's goodput against the run's SLOs ("" without SLOs)."""
    slo = p.get("slo") or {}
    if not slo:
        return ""
    each = ", ".join(f"p{e['percentile']:g} {e['metric'].upper()} {e['value_ms'] if e['value_ms'] is not None else '-'}"
                     f"/{e['max_ms']:g} ms" for e in slo.get("each", []))
    return (f"  goodput {slo.get('goodput', 0):.2f} req/s, {slo.get('attainment_pct', 0):.1f} % within every SLO"
            f" ({'met' if slo.get('met') else 'missed'}: {each})")
