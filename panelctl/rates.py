"""panelctl bench: open-loop request rates (--rate 2,4,8, --burstiness, --max-concurrency, a ramp)."""
from panelctl.client import BAD_INPUT, CliError


def rate_arguments(s) -> None:
    s.add_argument("--rate", default="", help="open-loop levels in requests/s, e.g. 2,4,8 (after the concurrency "
                   "levels; alone, only these run)")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps between requests: "
                   "1 is Poisson, below 1 burstier")
    s.add_argument("--max-concurrency", type=int, default=0, help="at a rate: at most this many in flight (0: no cap)")
    s.add_argument("--ramp", choices=["", "linear", "exponential"], default="", help="ramp each rate level up")
    s.add_argument("--ramp-from", type=float, default=0.0, help="requests/s at the ramp's start")
    s.add_argument("--arrival", choices=["poisson", "gamma"], default=None, help="how gaps are drawn (default: "
                   "poisson, gamma when --burstiness is not 1)")
    s.add_argument("--rate-duration", type=float, default=None, metavar="SECONDS", help="a rate level sends "
                   "max(min requests, rate x this) requests (default 30)")


def rate_body(args) -> dict:
    """The run's rate fields ({} without --rate); the panel checks the values and says what is wrong."""
    text = getattr(args, "rate", "") or ""  # a caller that builds its own arguments may leave rates out
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise CliError(f"--rate takes requests per second, e.g. 2,4,8 (got {text!r})", BAD_INPUT) from None
    if not rates:
        return {}
    body = {"rates": rates, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "ramp": args.ramp, "ramp_from": args.ramp_from}
    for field, value in (("arrival", getattr(args, "arrival", None)), ("rate_duration_s", getattr(args, "rate_duration", None))):
        body.update({field: value} if value is not None else {})
    return body


def asked(params: dict) -> str:
    """"concurrency 1, 8 and rates 2, 4 req/s", what a run measures."""
    out = [f"concurrency {', '.join(map(str, params['levels']))}"] if params.get("levels") else []
    if params.get("rates"):
        out.append(f"rates {', '.join(f'{r:g}' for r in params['rates'])} req/s")
    return " and ".join(out)


def point_key(p: dict) -> tuple:
    return p.get("kind", "concurrency"), p["concurrency"], p.get("rate", 0), p.get("repeat", 0)


def rate_line(p: dict) -> str:
    """A rate level's schedule as it was kept ("" for a concurrency level)."""
    if p.get("kind") != "rate":
        return ""
    waited = f", {p['slot_wait_ms'].get('count', 0)} waited for one of {p['concurrency']} slots" if p["concurrency"] else ""
    return f"  {p['rate']:g} req/s: sent {p['achieved_rate']:.2f}/s, lag p99 {p['lag_ms'].get('p99', 0):.2f} ms{waited}"
