"""The energy a deployment's GPUs draw while it is up, hour by hour: the node agent's watch reads the GPUs' energy
counters beside each ready engine's /metrics (deployments/node/watch.py), and this keeps what each interval between
two readings cost: its joules and seconds, whether the engine was idle through it (nothing running or waiting at both
ends, no token generated), and the output tokens the engine counted. The sums go to the database (DeploymentEnergy)
once a minute and when the hour turns; an agent killed in between loses at most that minute.

An interval belongs to the hour its later reading falls in. A counter that went back (the driver reloaded, the
engine restarted) ends the interval without counting it."""

import datetime as dt
import time
from dataclasses import dataclass, field

from django.db import DatabaseError, transaction
from django.db.models import F

from deployments.host import gpu
from deployments.models import DeploymentEnergy

FLUSH_S = 60.0


@dataclass
class Reading:
    at: float  # monotonic seconds
    millijoules: int
    tokens: float | None  # the engine's generation tokens counter
    busy: bool | None  # requests running or waiting; None when the engine did not say


@dataclass
class Hour:
    joules: float = 0.0
    seconds: float = 0.0
    idle_joules: float = 0.0
    idle_seconds: float = 0.0
    output_tokens: int = 0


@dataclass
class EnergyHours:
    """The agent's running sums: the last reading of each deployment and what is not yet in the database."""

    last: dict[int, Reading] = field(default_factory=dict)
    pending: dict[tuple[dt.datetime, int], Hour] = field(default_factory=dict)
    flushed_at: float | None = None

    def add(self, deployment_id: int, reading: Reading, hour: dt.datetime) -> None:
        """One reading of a deployment's GPUs (and engine) at `hour` (the hour's start, UTC)."""
        before, self.last[deployment_id] = self.last.get(deployment_id), reading
        if before is None or reading.at <= before.at or reading.millijoules < before.millijoules:
            return
        joules, seconds = (reading.millijoules - before.millijoules) / 1000.0, reading.at - before.at
        tokens = reading.tokens - before.tokens if None not in (reading.tokens, before.tokens) else None
        row = self.pending.setdefault((hour, deployment_id), Hour())
        row.joules += joules
        row.seconds += seconds
        row.output_tokens += int(max(0.0, tokens or 0.0))
        if before.busy is False and reading.busy is False and tokens == 0:
            row.idle_joules += joules
            row.idle_seconds += seconds

    def forget(self, keep: set[int]) -> None:
        """Deployments no longer up: their next reading starts afresh."""
        for pk in set(self.last) - keep:
            del self.last[pk]

    def due(self, hour: dt.datetime, now: float | None = None) -> bool:
        """Whether to flush: a minute since the last, or an hour that has ended waits."""
        now = time.monotonic() if now is None else now
        if self.flushed_at is None:
            self.flushed_at = now
        return bool(self.pending) and (now - self.flushed_at >= FLUSH_S or any(h != hour for h, _ in self.pending))

    def flush(self, now: float | None = None) -> None:
        """Add what is pending to each (hour, deployment) row, in one transaction; kept when the database is away."""
        now = time.monotonic() if now is None else now
        pending, self.pending = self.pending, {}
        try:
            with transaction.atomic():
                for (hour, pk), h in pending.items():
                    DeploymentEnergy.objects.get_or_create(hour=hour, deployment_id=pk)
                    DeploymentEnergy.objects.filter(hour=hour, deployment_id=pk).update(
                        joules=F("joules") + h.joules, seconds=F("seconds") + h.seconds,
                        idle_joules=F("idle_joules") + h.idle_joules, idle_seconds=F("idle_seconds") + h.idle_seconds,
                        output_tokens=F("output_tokens") + h.output_tokens)
        except DatabaseError:
            self.pending = pending  # nothing was written: all of it waits for the next flush
            raise
        self.flushed_at = now


def read(gpu_indices: list[int], gauges: dict | None) -> Reading | None:
    """A reading of these GPUs' counters with the engine's gauges (None: no GPUs, or no energy counters)."""
    millijoules = gpu.energy_mj(gpu_indices) if gpu_indices else None
    if millijoules is None:
        return None
    gauges = gauges or {}
    running = [gauges.get(k) for k in ("num_requests_running", "num_requests_waiting")]
    busy = None if None in running else bool(sum(running))
    return Reading(at=time.monotonic(), millijoules=millijoules, tokens=gauges.get("generation_tokens_total"), busy=busy)
