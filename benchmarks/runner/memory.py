"""The load generator's memory ceiling: a limit per process set with setrlimit, so that a run asking
for too much (or a bug) fails with MemoryError inside its own processes instead of leaving the kernel's
OOM killer to pick a victim on the host (the node agent, or the engine being measured).

RLIMIT_DATA, not RLIMIT_AS: since Linux 4.7 it counts every private writable mapping (the heap, Python's
arenas, large mallocs, thread stacks) but not the shared libraries, whose address space says nothing
about memory use. The budget of a run is split: half for the coordinating process, which merges every
worker's records of a level, and half shared among the measuring processes.
"""
import os
import resource

from .spec import RunnerError

KIND = resource.RLIMIT_DATA
MIB = 2**20
MIN_PROCESS_BYTES = 64 * MIB  # an interpreter with its event loop and queues starts in ~20 MiB of data
AUTO_MAX_BYTES = 16 * 2**30


class MemoryLimitError(RunnerError):
    """The load generator reached its memory limit and stopped; nothing else on the host was touched."""

    PERMANENT = True


def auto_bytes() -> int:
    """The default budget: a quarter of the host's memory, at most 16 GiB (a sweep of 1024 streams
    with 8,192-token outputs keeps about 1 GiB of per-chunk timestamps)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(MIN_PROCESS_BYTES * 2, min(AUTO_MAX_BYTES, total // 4))


def split(budget: int, workers: int) -> tuple[int, int]:
    """(coordinator, each worker) bytes of a budget; each at least MIN_PROCESS_BYTES."""
    half = budget // 2
    return max(MIN_PROCESS_BYTES, half), max(MIN_PROCESS_BYTES, half // max(1, workers))


def limit(nbytes: int) -> None:
    """Cap this process (and what it starts afterwards) at `nbytes`; the hard limit too, so that
    nothing running here can raise it again. Never raises a limit that is already lower."""
    if nbytes <= 0:
        return
    soft, hard = resource.getrlimit(KIND)
    if hard != resource.RLIM_INFINITY:
        nbytes = min(nbytes, hard)
    if soft != resource.RLIM_INFINITY:
        nbytes = min(nbytes, soft)
    resource.setrlimit(KIND, (nbytes, nbytes))


def current() -> int:
    """This process's limit in bytes (0: none)."""
    soft, _ = resource.getrlimit(KIND)
    return 0 if soft == resource.RLIM_INFINITY else soft


def out_of_memory(text: str) -> bool:
    """Whether an error or a dying process's last words say it ran out of memory."""
    return any(word in text for word in ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory"))
