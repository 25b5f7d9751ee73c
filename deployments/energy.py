"""What serving cost in energy: a deployment's joules per output token over a window, gross and net of its idle draw,
and each gateway key's share of them (from DeploymentEnergy, which the node agent fills: deployments/node/energyhours.py).

- Idle draw: the GPUs' watts while the engine had nothing running or waiting, over the window's idle seconds. Net of
  idle is the gross joules less that draw over the seconds counted: what serving itself cost. No idle second in the
  window, no net.
- A key's share of an hour of a deployment is its output tokens (the gateway's Usage rows) over the tokens the engine
  counted that hour (or the keys' sum, where that is more: the two counts come from different clocks); what no key
  asked for (calls straight to the engine, benchmarks) stays with the deployment."""

import datetime as dt

from django.db.models import Sum
from django.utils import timezone

from deployments.gateway import usage
from deployments.models import DeploymentEnergy

FIELDS = ("joules", "seconds", "idle_joules", "idle_seconds", "output_tokens")
MAX_HOURS = 24 * 366


def _per_token(joules, tokens):
    return round(joules / tokens, 4) if joules is not None and tokens else None


def summary(sums: dict) -> dict:
    """Joules, kWh, idle watts, net joules and joules per output token (gross, net) from the FIELDS' sums."""
    joules, seconds = sums.get("joules") or 0.0, sums.get("seconds") or 0.0
    idle_j, idle_s, tokens = sums.get("idle_joules") or 0.0, sums.get("idle_seconds") or 0.0, sums.get("output_tokens") or 0
    idle_w = idle_j / idle_s if idle_s > 0 else None
    net = max(0.0, joules - idle_w * seconds) if idle_w is not None else None
    return {"joules": round(joules, 1), "kwh": round(joules / 3.6e6, 6), "seconds": round(seconds, 1),
            "output_tokens": tokens, "average_watts": round(joules / seconds, 1) if seconds else None,
            "idle_watts": round(idle_w, 1) if idle_w is not None else None,
            "joules_net": round(net, 1) if net is not None else None,
            "joules_per_token": _per_token(joules, tokens), "joules_per_token_net": _per_token(net, tokens)}


def since(hours: int, now=None) -> dt.datetime:
    return usage.hour_of(now or timezone.now()) - dt.timedelta(hours=hours - 1)


def deployment_energy(deployment_id: int, hours: int = 24, now=None) -> dict:
    """The deployment's last `hours` (the current one included): the summary, and each hour's."""
    rows = list(DeploymentEnergy.objects.filter(deployment_id=deployment_id, hour__gte=since(hours, now))
                .values("hour", *FIELDS))
    totals = {f: sum(r[f] for r in rows) for f in FIELDS}
    return {"hours": hours, **summary(totals),
            "by_hour": [{"hour": r["hour"].isoformat(), **summary(r)} for r in rows]}


def totals() -> dict[int, dict]:
    """All-time sums per deployment (what /metrics exposes as counters)."""
    return {r["deployment_id"]: r for r in DeploymentEnergy.objects.values("deployment_id").annotate(
        **{f: Sum(f) for f in FIELDS})}


def hour_shares(hours: set, deployment_ids: set) -> dict[tuple, tuple[float, float | None, int]]:
    """{(hour, deployment id): (joules, net joules or None, tokens to share them over)} for those hours."""
    if not hours or not deployment_ids:
        return {}
    rows = DeploymentEnergy.objects.filter(hour__in=hours, deployment_id__in=deployment_ids).values(
        "hour", "deployment_id", *FIELDS)
    out = {}
    for r in rows:
        s = summary(r)
        out[(r["hour"], r["deployment_id"])] = (r["joules"], s["joules_net"], r["output_tokens"])
    return out


def keys_share(usage_rows: list[dict]) -> list[tuple[float | None, float | None]]:
    """For each usage row ({hour, deployment_id, reasoning_tokens, content_tokens}: one key's hour of one deployment),
    its share of that hour's joules, gross and net of idle: (None, None) where the hour has no energy reading."""
    energy = hour_shares({r["hour"] for r in usage_rows}, {r["deployment_id"] for r in usage_rows if r["deployment_id"]})
    tokens = [(r["reasoning_tokens"] or 0) + (r["content_tokens"] or 0) for r in usage_rows]
    asked: dict[tuple, int] = {}
    for r, n in zip(usage_rows, tokens):
        asked[(r["hour"], r["deployment_id"])] = asked.get((r["hour"], r["deployment_id"]), 0) + n
    shares = []
    for r, n in zip(usage_rows, tokens):
        key = (r["hour"], r["deployment_id"])
        if key not in energy:
            shares.append((None, None))
            continue
        joules, net, counted = energy[key]
        over = max(counted, asked[key])
        part = n / over if over else 0.0
        shares.append((joules * part, net * part if net is not None else None))
    return shares
