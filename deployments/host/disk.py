"""Disk space and host load of this node, read without touching the filesystem."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class DiskUsage:
    """Space on the filesystem holding `path` (the nearest existing folder), in bytes."""

    path: str
    total: int
    used: int
    free: int  # what an unprivileged process can still write


@dataclass(frozen=True)
class HostStats:
    """Memory in bytes, load averages, CPU count and use, and network byte counters of the host."""

    ram_total: int
    ram_available: int
    load1: float
    load5: float
    load15: float
    cpu_count: int
    cpu_percent: float = 0.0  # all cores, since the previous call (0.0 at the first)
    net_sent: int = 0  # bytes since boot, all interfaces but loopback
    net_recv: int = 0


def disk_usage(path: str | os.PathLike) -> DiskUsage:
    """Space where `path` will live: a missing path is measured at its nearest existing parent."""
    here = os.path.abspath(path)
    # os.path.exists (unlike Path.exists) also reads an unreadable folder as missing and walks on.
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    usage = shutil.disk_usage(here)
    return DiskUsage(path=here, total=usage.total, used=usage.used, free=usage.free)


def host_stats() -> HostStats:
    """Memory, load, CPU and network counters of the host right now."""
    memory = psutil.virtual_memory()
    load1, load5, load15 = os.getloadavg()
    sent = recv = 0
    for name, counters in psutil.net_io_counters(pernic=True).items():
        if name != "lo":
            sent, recv = sent + counters.bytes_sent, recv + counters.bytes_recv
    return HostStats(
        ram_total=memory.total,
        ram_available=memory.available,
        load1=load1,
        load5=load5,
        load15=load15,
        cpu_count=os.cpu_count() or 1,
        cpu_percent=psutil.cpu_percent(interval=None),
        net_sent=sent,
        net_recv=recv,
    )
