"""Telemetry history, bounded two ways: the last hour at full rate (1 s) in a Redis list per node,
and one row per minute in the database (NodeMetric) for a week. Neither grows without limit."""
import json
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import orjson
from django.utils import timezone

from deployments.models import NodeMetric
from plumbing import redisconn

RECENT_SECONDS = 3600
RETENTION = timedelta(days=7)


def _key(node_id: int) -> str:
    return redisconn.key("history", node_id)


def compact(sample: dict) -> dict:
    """The chartable part of a sample: per GPU memory, utilization, temperature and power; the host's
    CPU, RAM, model-store disk and network."""
    host = sample["host"]
    return {
        "t": sample["t"],
        "gpus": [
            {"index": g["index"], "memory_used": g["memory_used"], "memory_total": g["memory_total"],
             "util_gpu": g["util_gpu"], "temperature_c": g["temperature_c"], "power_w": g["power_w"]}
            for g in sample.get("gpus", [])
        ],
        "disk_free": sample["disk"]["free"],
        "disk_total": sample["disk"].get("total"),
        "ram_available": host["ram_available"],
        "ram_total": host.get("ram_total"),
        "load1": host["load1"],
        "cpu_percent": host.get("cpu_percent"),
        "net_rx_bps": host.get("net_rx_bps"),
        "net_tx_bps": host.get("net_tx_bps"),
    }


def push(node_id: int, sample: dict, sample_seconds: float = 1.0) -> None:
    """Append a sample to the node's last-hour list, trimmed to an hour of samples."""
    keep = max(60, int(RECENT_SECONDS / max(sample_seconds, 0.1)))
    pipe = redisconn.client().pipeline()
    pipe.rpush(_key(node_id), json.dumps(compact(sample), separators=(",", ":")))
    pipe.ltrim(_key(node_id), -keep, -1)
    pipe.expire(_key(node_id), RECENT_SECONDS * 2)
    pipe.execute()


def recent(node_id: int, since: float = 0.0) -> list[dict]:
    """Full-rate samples of the last hour taken after `since` (a Unix time)."""
    samples = (json.loads(raw) for raw in redisconn.client().lrange(_key(node_id), 0, -1))
    return [s for s in samples if s["t"] > since]


def latest(node_id: int) -> dict | None:
    """The node's last sample (compact), or None."""
    raw = redisconn.client().lindex(_key(node_id), -1)
    return json.loads(raw) if raw else None


_LAST_OF_EACH = "local found = {} for i, key in ipairs(KEYS) do found[i] = redis.call('LINDEX', key, -1) or false end return found"


def latest_many(node_ids: list[int]) -> dict[int, dict | None]:
    """latest() of each node, in one command (a pipeline of a hundred LINDEXes cost 5 ms of client CPU)."""
    if not node_ids:
        return {}
    found = redisconn.client().eval(_LAST_OF_EACH, len(node_ids), *[_key(node_id) for node_id in node_ids])
    return {node_id: orjson.loads(raw) if raw else None for node_id, raw in zip(node_ids, found)}


def minutes(node_id: int, since: timedelta) -> list[dict]:
    """Per-minute rows of the last `since` (at most a week)."""
    start = timezone.now() - min(since, RETENTION)
    return [{"t": row.t.timestamp(), **row.data} for row in NodeMetric.objects.filter(node_id=node_id, t__gte=start)]


class MinuteAggregator:
    """Folds full-rate samples into one row per minute: mean memory and utilization, peaks too."""

    def __init__(self):
        self.minute = None
        self.samples: list[dict] = []

    def add(self, sample: dict) -> dict | None:
        """Add a sample; when a minute closes, return its aggregate (with "t" the minute start)."""
        minute = int(sample["t"] // 60) * 60
        closed = None
        if self.minute is not None and minute != self.minute and self.samples:
            closed = self._aggregate()
            self.samples = []
        self.minute = minute
        self.samples.append(compact(sample))
        return closed

    def _aggregate(self) -> dict:
        gpus = {}
        for s in self.samples:
            for g in s["gpus"]:
                gpus.setdefault(g["index"], []).append(g)
        return {
            "t": self.minute,
            "gpus": [
                {"index": i, "memory_total": rows[-1]["memory_total"],
                 "memory_used": _mean(r["memory_used"] for r in rows), "memory_used_max": _max(r["memory_used"] for r in rows),
                 "util_gpu": _mean(r["util_gpu"] for r in rows), "util_gpu_max": _max(r["util_gpu"] for r in rows),
                 "temperature_c": _max(r["temperature_c"] for r in rows), "power_w": _mean(r["power_w"] for r in rows)}
                for i, rows in sorted(gpus.items())
            ],
            "disk_free": self.samples[-1]["disk_free"],
            "disk_total": self.samples[-1].get("disk_total"),
            "ram_available": _mean(s["ram_available"] for s in self.samples),
            "ram_total": self.samples[-1].get("ram_total"),
            "load1": _mean(s["load1"] for s in self.samples),
            **{key: _mean(s.get(key) for s in self.samples) for key in ("cpu_percent", "net_rx_bps", "net_tx_bps")},
            "samples": len(self.samples),
        }


def record_minute(node_id: int, aggregate: dict) -> None:
    """Store one minute and drop rows past the retention bound."""
    t = datetime.fromtimestamp(aggregate["t"], tz=dt_timezone.utc)
    data = {k: v for k, v in aggregate.items() if k != "t"}
    NodeMetric.objects.update_or_create(node_id=node_id, t=t, defaults={"data": data})
    NodeMetric.objects.filter(node_id=node_id, t__lt=timezone.now() - RETENTION).delete()


def _mean(values):
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _max(values):
    known = [v for v in values if v is not None]
    return max(known) if known else None


