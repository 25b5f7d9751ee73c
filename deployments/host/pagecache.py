"""Model files and the page cache: how much of them is resident (mincore), dropping them from the
cache (posix_fadvise DONTNEED), reading them in ahead of a load (pre-warm), the store's own
sequential read rate, and how fast an engine's processes read. Plain Python, no Django.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from deployments.host.errors import HostError

CHUNK = 8 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


class PageCacheError(HostError):
    """Page-cache residency could not be read or changed."""

    PERMANENT = True


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """A model folder's weight files, largest first (what a loader reads)."""
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def resident_bytes(path: str | os.PathLike) -> int:
    """Bytes of `path` in the page cache now: mincore over a mapping that is never touched, so
    nothing is read in by asking."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise PageCacheError(f"mmap({path}): {os.strerror(ctypes.get_errno())}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise PageCacheError(f"mincore({path}): {os.strerror(ctypes.get_errno())}")
            # Only bit 0 is defined; translate + count stay in C for a 100 GB model's millions of pages.
            return min(size, bytes(vec).translate(_LOW_BIT).count(1) * mmap.PAGESIZE)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Residency:
    resident: int
    total: int

    @property
    def percent(self) -> float:
        return round(100.0 * self.resident / self.total, 1) if self.total else 0.0


def residency(paths: list[Path]) -> Residency:
    """How much of these files is in the page cache."""
    return Residency(sum(resident_bytes(p) for p in paths), sum(p.stat().st_size for p in paths))


def drop(path: str | os.PathLike) -> None:
    """Ask the kernel to drop the file's clean pages (pages a process has mapped stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(path: Path, limit: int | None = None, on_bytes: Callable[[int], None] | None = None) -> int:
    """Read a file sequentially (up to `limit` bytes) into one reused buffer; returns bytes read."""
    done, buf = 0, memoryview(bytearray(CHUNK))
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while limit is None or done < limit:
            n = f.readinto(buf if limit is None else buf[: min(CHUNK, limit - done)])
            if not n:
                break
            done += n
            if on_bytes:
                on_bytes(n)
    return done


@dataclass(frozen=True)
class ReadRate:
    """Sequential read rate of a store: bytes read, seconds, whether the cache was dropped first."""

    bytes: int
    seconds: float
    cold: bool

    @property
    def bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def measure_read_rate(paths: list[Path], max_bytes: int = 1 << 30, keep: frozenset[Path] = frozenset()) -> ReadRate:
    """Read up to `max_bytes` of these files sequentially at idle priority, cold where allowed.

    Files in `keep` (a running engine's) are never dropped from the cache, and files are dropped
    again after reading only when they were not resident before, so a measurement evicts nothing
    another process needs. The calling thread drops to nice 19 (Linux: per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError:
        pass
    chosen, total = [], 0
    for p in paths:
        if total >= max_bytes:
            break
        if p in keep:
            continue
        chosen.append(p)
        total += min(p.stat().st_size, max_bytes - total)
    if not chosen:
        raise PageCacheError("no model file to measure that no running engine uses")
    was_resident = {p: resident_bytes(p) for p in chosen}
    for p in chosen:
        drop(p)
    cold = all(resident_bytes(p) == 0 for p in chosen)
    left, started = max_bytes, time.perf_counter()
    done = 0
    for p in chosen:
        n = _read(p, left)
        done, left = done + n, left - n
    seconds = time.perf_counter() - started
    for p in chosen:
        if not was_resident[p]:
            drop(p)
    return ReadRate(bytes=done, seconds=seconds, cold=cold)


def prewarm(paths: list[Path], workers: int = 4, on_bytes: Callable[[int], None] | None = None) -> ReadRate:
    """Read whole files into the page cache, `workers` files at a time (parallel reads keep an
    NVMe's queue full where one sequential reader does not)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        done = sum(pool.map(lambda p: _read(p, None, on_bytes), paths))
    return ReadRate(bytes=done, seconds=time.perf_counter() - started, cold=False)


def process_read_bytes(pid: int) -> int:
    """Bytes a process and its children fetched from storage (/proc/<pid>/io read_bytes), 0 if gone.
    Page-cache hits do not count: this is the loader's disk rate, not its copy rate."""
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in members:
        try:
            total += p.io_counters().read_bytes
        except (psutil.Error, AttributeError):
            continue
    return total
