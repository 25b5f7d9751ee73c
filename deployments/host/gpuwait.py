"""The wait for GPU memory to come back before an engine starts: for the processes stopped (every compute process,
when the caller names none), never for a display server (it is never stopped: its memory stays), and until the
driver has handed the memory back, not only until the process has left NVML's lists."""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from deployments.host import gpu, ownership
from deployments.host.gpu import GpuProcess, MemoryNotReleased

MIB = 1024**2
# Used memory that no listed process accounts for, within which the memory counts as back: an H100 (driver 580)
# read 8 MiB beside one process, and 0 used once it had exited.
UNEXPLAINED_BYTES = 256 * MIB
# Memory nobody listed holds (a process in another container, a driver still handing it back) counts as back once
# it has fallen by no more than UNEXPLAINED_BYTES for this long.
SETTLE_S = 0.5


@dataclass(frozen=True)
class Kept:
    """A process holding memory on a GPU that the wait does not wait for, and why."""

    index: int
    pid: int
    name: str
    used_memory: int | None
    why: str

    def describe(self) -> str:
        held = "an unknown amount" if self.used_memory is None else f"{self.used_memory // MIB:,} MiB"
        return f"GPU {self.index}: {self.name} (PID {self.pid}) holds {held}; {self.why}, not waited for"


def is_display_server(proc: GpuProcess, described: dict[int, dict]) -> bool:
    """ownership.is_display_server of an NVML process, by NVML's name or the process's own (read once per PID into
    `described`: a wait polls five times a second, and a PID's display server stays one)."""
    if proc.pid not in described:
        described[proc.pid] = ownership.describe(proc.pid)
    by_nvml = {"name": os.path.basename(proc.name or ""), "command": proc.name or ""}
    return ownership.is_display_server(described[proc.pid], proc.graphics) or ownership.is_display_server(by_nvml)


def wait_memory_released(indices: Iterable[int], pids: Iterable[int] | None, timeout_s: float, poll_s: float = 0.2,
                         ignore: Iterable[int] = ()) -> list[Kept]:
    """Return once none of `pids` (every process, if None) holds memory on `indices` and the GPUs' used memory is
    back; display servers and `ignore` (engines asleep on these GPUs keep their CUDA context) are not waited for:
    returned, with what they hold. MemoryNotReleased at the timeout names the PIDs still holding memory."""
    indices, wanted, spare = list(indices), None if pids is None else set(pids), set(ignore)
    deadline = time.monotonic() + timeout_s
    readings: list[tuple[float, int]] = []  # (when, used memory of the GPUs) once no process is waited for
    described: dict[int, dict] = {}
    while True:
        by_gpu = gpu.processes_on(indices)
        kept = _kept(by_gpu, spare, described)
        staying = {k.pid for k in kept}
        holding = {pid: b for pid, b in _holding(by_gpu, wanted).items() if pid not in staying}
        now = time.monotonic()
        if not holding and _memory_back(by_gpu, gpu.memory_used(indices), readings, now):
            return kept
        if now >= deadline:
            if holding:
                raise MemoryNotReleased(holding, timeout_s=timeout_s)
            return kept  # still falling after the whole wait, with nobody listed: the engine's start will tell
        time.sleep(poll_s)


def _kept(by_gpu: dict[int, list[GpuProcess]], spare: set[int], described: dict[int, dict]) -> list[Kept]:
    kept = []
    for index, procs in sorted(by_gpu.items()):
        for proc in procs:
            why = ("an engine asleep" if proc.pid in spare
                   else "a display server" if is_display_server(proc, described) else None)
            if why:
                kept.append(Kept(index, proc.pid, os.path.basename(proc.name or "") or "?", proc.used_memory, why))
    return kept


def _memory_back(by_gpu: dict[int, list[GpuProcess]], used: dict[int, int | None], readings: list, now: float) -> bool:
    """Whether the memory of the processes gone is back: what the GPUs use is what the listed processes hold (give or
    take UNEXPLAINED_BYTES), or it has stopped falling for SETTLE_S. Where NVML won't say, the lists decide."""
    if any(v is None for v in used.values()):
        return True
    total = sum(used.values())
    listed = sum(p.used_memory or 0 for procs in by_gpu.values() for p in procs)
    if total - listed <= UNEXPLAINED_BYTES:
        return True
    readings.append((now, total))
    earlier = [u for t, u in readings if t <= now - SETTLE_S]
    return bool(earlier) and earlier[-1] - total <= UNEXPLAINED_BYTES


def _holding(by_gpu: dict[int, list[GpuProcess]], pids: set[int] | None) -> dict[int, int | None]:
    """Bytes each wanted PID still holds over all GPUs; None when the driver won't say."""
    held: dict[int, int | None] = {}
    for procs in by_gpu.values():
        for proc in procs:
            if (pids is not None and proc.pid not in pids) or proc.used_memory == 0:
                continue
            if proc.pid not in held:
                held[proc.pid] = proc.used_memory
            elif held[proc.pid] is None or proc.used_memory is None:
                held[proc.pid] = None
            else:
                held[proc.pid] += proc.used_memory
    return held


def kept_text(kept: list[Kept]) -> str:
    """What the wait left holding memory, for the deploy's timeline: "" when nothing."""
    return "".join(f" {k.describe()}." for k in kept)
