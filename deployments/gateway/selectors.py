"""Reads of the gateway's control plane: callers' keys as lists show them, and usage summed by hour or day per key,
model name or deployment (the gateways may write several rows for one group and hour: readers always sum)."""
from datetime import timedelta, timezone as tz

from django.db.models import Sum
from django.db.models.functions import TruncDay, TruncHour
from django.utils import timezone

from deployments import energy
from deployments.gateway.models import CallerKey, Route, Usage
from plumbing import csvsafe
from plumbing.errors import ServiceError

MEASURES = ("requests", "errors", "refused", "prompt_tokens", "reasoning_tokens", "content_tokens")
ENERGY = ("energy_j", "energy_net_j")  # the rows' share of their deployments' GPU joules (deployments/energy.py)
GROUPS = {"key": ("key_id", "key__name", "key__prefix"), "model": ("model_name",),
          "deployment": ("deployment_id", "deployment__name")}
BY = {"hour": TruncHour, "day": TruncDay}
DEFAULT_DAYS = {"hour": 2, "day": 30}
MAX_DAYS = 366


def route_of(deployment_id: int) -> dict:
    """A deployment's settings at the gateway (its defaults where it has no route)."""
    route = Route.objects.filter(deployment_id=deployment_id).first()
    return {"aliases": route.names if route else [], "max_in_flight": route.max_in_flight if route else None,
            "queue_bound": route.queue_bound if route else 256, "media_domains": route.media_domains if route else []}


def keys_listed(owner=None):
    """Callers' keys (never the panel's internal ones), newest first, with their usage totals; `owner`: only theirs."""
    keys = CallerKey.objects.filter(internal=False).select_related("owner").prefetch_related("deployments")
    if owner is not None:
        keys = keys.filter(owner=owner)
    return keys.annotate(**{f"used_{m}": Sum(f"usage__{m}") for m in MEASURES}).order_by("revoked_at", "-created")


def key_label(name, prefix) -> str:
    return f"{name} ({prefix}…)" if name is not None else "(deleted key)"


def _label(group: str, row: dict) -> str:
    if group == "key":
        return key_label(row["key__name"], row["key__prefix"])
    if group == "deployment":
        return row["deployment__name"] or "(deleted deployment)"
    return row["model_name"]


def window(by: str, days=None, now=None) -> tuple:
    """(since, until) of a usage query: the last `days` (the default by resolution), whole hours."""
    if by not in BY:
        raise ServiceError("by: hour or day.", field="by")
    if days in (None, ""):
        days = DEFAULT_DAYS[by]
    try:
        days = int(days)
    except (TypeError, ValueError):
        raise ServiceError(f"days: a whole number from 1 to {MAX_DAYS}.", field="days") from None
    if not 1 <= days <= MAX_DAYS:
        raise ServiceError(f"days: a whole number from 1 to {MAX_DAYS}.", field="days")
    until = (now or timezone.now()).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    return until - timedelta(days=days), until


def periods(by: str, days=None, now=None) -> list:
    """Every period (hour or day, UTC) of the window, oldest first: the usage charts' time axis."""
    since, until = window(by, days, now)
    step = timedelta(hours=1) if by == "hour" else timedelta(days=1)
    start = since if by == "hour" else since.replace(hour=0)
    return [start + i * step for i in range(int((until - start) / step)) if start + i * step < until]


def usage(group: str = "key", by: str = "hour", days=None, key_id: int | None = None, now=None) -> list[dict]:
    """[{period, group, label, requests, errors, prompt_tokens, reasoning_tokens, content_tokens, energy_j,
    energy_net_j}] in period order. The energy is each row's share of its deployments' GPU joules, gross and net of
    idle (deployments/energy.py); None where an hour of it has no reading (a partial sum
    would read low without saying so; the usage page's totals per label add the periods that have one)."""
    if group not in GROUPS:
        raise ServiceError("group: key, model or deployment.", field="group")
    since, until = window(by, days, now)
    rows = Usage.objects.filter(hour__gte=since, hour__lt=until)
    if key_id is not None:
        rows = rows.filter(key_id=key_id)
    # By hour and deployment first (the grain the energy is shared at), then summed into the periods asked for.
    grain = list(rows.values("hour", "deployment_id", *GROUPS[group]).annotate(**{m: Sum(m) for m in MEASURES})
                 .order_by("hour", *GROUPS[group]))
    out: dict[tuple, dict] = {}
    for row, shares in zip(grain, energy.keys_share(grain)):
        period = row["hour"].astimezone(tz.utc).replace(minute=0, second=0, microsecond=0)
        period = period.replace(hour=0) if by == "day" else period
        into = out.setdefault((period, tuple(row[f] for f in GROUPS[group])), {
            "period": period, "group": group, "label": _label(group, row), **{m: 0 for m in MEASURES + ENERGY}})
        for m in MEASURES:
            into[m] += row[m] or 0
        for m, value in zip(ENERGY, shares):
            into[m] = None if value is None or into[m] is None else into[m] + value
    for into in out.values():
        for m in ENERGY:
            into[m] = round(into[m], 1) if into[m] is not None else None
    order = sorted(out, key=lambda k: (k[0], [(v is None, v if v is not None else "") for v in k[1]]))
    return [out[k] for k in order]


CSV_COLUMNS = ["period", "group", "name", *MEASURES, *ENERGY]


def usage_csv(rows: list[dict]) -> str:
    """The rows as CSV; names (keys, aliases) a spreadsheet would run as formulas are quoted (csvsafe)."""
    return csvsafe.rows_text(CSV_COLUMNS, ([r["period"].isoformat(), r["group"], r["label"],
                                            *(r[m] for m in MEASURES + ENERGY)] for r in rows))


def usage_totals() -> list[dict]:
    """All-time sums per (key, model name, deployment): what /metrics exposes as counters (no hour in the labels,
    so the label sets stay as small as the combinations ever used)."""
    rows = (Usage.objects.values("key__name", "key__prefix", "model_name", "deployment__name")
            .annotate(**{m: Sum(m) for m in MEASURES}).order_by("key__name", "model_name", "deployment__name"))
    return list(rows)

