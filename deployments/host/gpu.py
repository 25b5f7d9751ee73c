"""NVML snapshots of this host's GPUs: the only module that imports pynvml."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import pynvml

from deployments.host.errors import HostError

GIB = 1024**3
POWER_LIMIT_TTL_S = 10.0
T = TypeVar("T")


class NvmlUnavailable(HostError):
    """NVML cannot start: the node has no usable NVIDIA GPU (no driver, no library)."""

    PERMANENT = True

    def __init__(self, reason: str):
        super().__init__(f"no NVIDIA GPU on this node: {reason}")
        self.reason = reason


class MemoryNotReleased(HostError):
    """Processes still hold GPU memory after the wait ran out (not permanent: a stuck process may
    still exit later; the caller decides whether to wait again)."""

    def __init__(self, pids_still_holding: dict[int, int | None], timeout_s: float | None = None):
        held = ", ".join(
            f"PID {pid} holds {_gib(used)}" for pid, used in sorted(pids_still_holding.items())
        )
        after = f" after {timeout_s:g} s" if timeout_s is not None else ""
        super().__init__(f"GPU memory not released{after}: {held}")
        self.pids_still_holding = pids_still_holding
        self.timeout_s = timeout_s


@dataclass(frozen=True)
class GpuInfo:
    """What does not change while the host runs: identity and size of one GPU."""

    index: int
    uuid: str | None
    name: str | None
    memory_total: int | None
    compute_capability: str | None  # "9.0"


@dataclass(frozen=True)
class GpuProcess:
    """A process with a context on a GPU; used_memory in bytes, None when the driver won't say."""

    pid: int
    used_memory: int | None
    name: str | None = None
    graphics: bool = False  # listed as a graphics process only, as display servers are (Xorg, gnome-shell)


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU; any None means the driver could not tell."""

    index: int
    uuid: str | None
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    util_gpu: int | None
    util_memory: int | None
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: int | None
    pcie_gen: int | None
    pcie_width: int | None
    processes: list[GpuProcess] | None = field(default_factory=list)  # None: not listable
    ecc_sbe_volatile: int | None = None  # ECC errors since the driver loaded: corrected (single bit)
    ecc_dbe_volatile: int | None = None  # and uncorrected (double bit); None without ECC


class Nvml:
    """One NVML session: handles and static facts read once, then cheap reads."""

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(str(exc)) from exc
        self.pid = os.getpid()
        self._limits: dict[int, tuple[float, int | None]] = {}
        self.gpus = [self._info(i, h) for i, h in enumerate(self.handles)]

    def _info(self, index: int, handle) -> GpuInfo:
        memory = _read(lambda: _memory_info(handle))
        cc = _read(lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle))
        return GpuInfo(
            index=index,
            uuid=_read(lambda: _text(pynvml.nvmlDeviceGetUUID(handle))),
            name=_read(lambda: _text(pynvml.nvmlDeviceGetName(handle))),
            memory_total=memory.total if memory is not None else None,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else None,
        )

    def sample(self, index: int) -> GpuSample:
        """Read every live figure of GPU `index`, each on its own."""
        h = self.handles[index]
        memory = _read(lambda: _memory_info(h))
        util = _read(lambda: pynvml.nvmlDeviceGetUtilizationRates(h))
        power_mw = _read(lambda: pynvml.nvmlDeviceGetPowerUsage(h))
        limit_mw = self._power_limit_mw(index)
        return GpuSample(
            index=index,
            uuid=self.gpus[index].uuid,
            memory_total=memory.total if memory is not None else self.gpus[index].memory_total,
            memory_used=memory.used if memory is not None else None,
            memory_free=memory.free if memory is not None else None,
            util_gpu=util.gpu if util is not None else None,
            util_memory=util.memory if util is not None else None,
            temperature_c=_read(
                lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
            ),
            power_w=power_mw / 1000 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000 if limit_mw is not None else None,
            sm_clock_mhz=_read(lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            pcie_gen=_read(lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            pcie_width=_read(lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
            processes=self.processes(index),
            ecc_sbe_volatile=_read(lambda: _ecc_errors(h, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED)),
            ecc_dbe_volatile=_read(lambda: _ecc_errors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)),
        )

    def _power_limit_mw(self, index: int) -> int | None:
        # A setting, not a reading, and ~175 µs on an H200 against ~60 µs for all other figures.
        now = time.monotonic()
        cached = self._limits.get(index)
        if cached is None or now - cached[0] >= POWER_LIMIT_TTL_S:
            h = self.handles[index]
            cached = (now, _read(lambda: pynvml.nvmlDeviceGetPowerManagementLimit(h)))
            self._limits[index] = cached
        return cached[1]

    def processes(self, index: int) -> list[GpuProcess] | None:
        """Compute and graphics processes of GPU `index`, merged by PID; None if neither lists."""
        h = self.handles[index]
        compute = _read(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        graphics = _read(lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses(h))
        if compute is None and graphics is None:
            return None
        used: dict[int, int | None] = {}
        drawing = {p.pid for p in graphics or []} - {p.pid for p in compute or []}
        for proc in [*(compute or []), *(graphics or [])]:
            mine = proc.usedGpuMemory
            # A "C+G" process is listed twice with the same memory: keep the larger figure.
            seen = used.get(proc.pid)
            used[proc.pid] = mine if seen is None else max(seen, mine or 0)
        return [
            GpuProcess(pid=pid, used_memory=mem, name=_read(lambda: _process_name(pid)), graphics=pid in drawing)
            for pid, mem in used.items()
        ]


_session: Nvml | None = None
_lock = threading.Lock()


def _nvml() -> Nvml:
    """The process's NVML session, started on first use and again after a fork."""
    global _session
    with _lock:
        if _session is None or _session.pid != os.getpid():
            _session = Nvml()
        return _session


def inventory() -> list[GpuInfo]:
    """Identity, size and compute capability of every GPU; raises NvmlUnavailable."""
    return list(_nvml().gpus)


def sample(indices: Iterable[int] | None = None) -> list[GpuSample]:
    """Live figures of the given GPUs (all by default); a field NVML refuses becomes None."""
    nvml = _nvml()
    wanted = range(len(nvml.handles)) if indices is None else indices
    return [nvml.sample(i) for i in wanted]


def processes_on(indices: Iterable[int]) -> dict[int, list[GpuProcess]]:
    """Processes holding a context on each GPU; a GPU that can't list them maps to []."""
    nvml = _nvml()
    return {i: nvml.processes(i) or [] for i in indices}


def memory_used(indices: Iterable[int]) -> dict[int, int | None]:
    """Used memory of each GPU (the driver's reserve apart where the driver says), None where NVML won't say."""
    nvml = _nvml()
    return {i: getattr(_read(lambda h=nvml.handles[i]: _memory_info(h)), "used", None) for i in indices}


def energy_mj(indices: Iterable[int]) -> int | None:
    """The GPUs' energy counters summed, in millijoules since the driver loaded (nvmlDeviceGetTotalEnergyConsumption,
    Volta and newer); None when any of them cannot say (an older GPU, no NVML here)."""
    try:
        nvml = _nvml()
    except NvmlUnavailable:
        return None
    total = 0
    for i in indices:
        if not 0 <= i < len(nvml.handles):  # a GPU the driver no longer shows (a row older than its view)
            return None
        h = nvml.handles[i]
        value = _read(lambda h=h: pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        if value is None:
            return None
        total += value
    return total


class EnergyMeter:
    """Readings of the GPUs' energy counters over time, to tell the joules spent between two moments of this
    process's monotonic clock (a benchmark level's measured window) by interpolating between readings."""

    def __init__(self, indices: Iterable[int], read: Callable[[list[int]], int | None] | None = None):
        self.indices, self._read_counters = list(indices), read  # None: energy_mj
        self.readings: list[tuple[float, int]] = []
        self.supported = bool(self.indices)

    def read(self, now: float | None = None) -> float:
        """Take a reading; returns its moment (now, when nothing could be read)."""
        now = time.monotonic() if now is None else now
        if not self.supported:
            return now
        value = (self._read_counters or energy_mj)(self.indices)
        if value is None:
            self.supported = False
            return now
        self.readings.append((now, value))
        del self.readings[:-4096]  # hours of a reading a second
        return now

    def _at(self, t: float) -> float | None:
        before = [r for r in self.readings if r[0] <= t]
        after = [r for r in self.readings if r[0] >= t]
        if not before or not after:
            return None
        (t0, e0), (t1, e1) = before[-1], after[0]
        return float(e0) if t1 == t0 else e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def joules(self, start: float, end: float) -> float | None:
        """Joules the GPUs used between `start` and `end`; None unless readings cover the whole window."""
        if not self.supported:
            return None
        first, last = self._at(start), self._at(end)
        if first is None or last is None or last < first:
            return None
        return (last - first) / 1000.0


def _read(fn: Callable[[], T]) -> T | None:
    """One NVML call; any NVML error (NotSupported, GPU lost...) reads as unknown."""
    try:
        return fn()
    except pynvml.NVMLError:
        return None


def _ecc_errors(handle, error_type) -> int:
    return pynvml.nvmlDeviceGetTotalEccErrors(handle, error_type, pynvml.NVML_VOLATILE_ECC)


def _memory_info(handle):
    # v2 counts the driver's reserved memory apart from "used", as nvidia-smi does on drivers that have v2. Older
    # drivers have only v1, whose "used" includes the reserved memory (total = used + free) and whose nvidia-smi shows
    # that figure: it is kept as it is, since v1 does not say how much of it is reserved.
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except pynvml.NVMLError:
        return pynvml.nvmlDeviceGetMemoryInfo(handle)


def _process_name(pid: int) -> str | None:
    return _text(pynvml.nvmlSystemGetProcessName(pid)) or None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _gib(used: int | None) -> str:
    return "an unknown amount" if used is None else f"{used / GIB:.1f} GiB"


# --- What the host doctor asks NVML (deployments/host/doctor.py judges it) ------------------------------------

P2P_CAPS_INDEX_READ = 0  # pynvml 13.615 spells NVML_P2P_CAPS_INDEX_READ as the tuple (0,)
# NVML's common-ancestor levels, nearest first, as nvidia-smi topo -m names them.
TOPOLOGY_LEVELS = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
P2P_STATUS = {0: "OK", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
              4: "disabled by regkey", 5: "not supported"}
SLOWDOWN_REASONS = {0x8: "HW slowdown", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
                    0x80: "HW power brake"}


@dataclass(frozen=True)
class GpuFacts:
    """One GPU's settings the doctor checks; any None means NVML could not tell."""

    index: int
    name: str | None
    pci_bus_id: str | None  # "0000:18:00.0", as /sys/bus/pci/devices names it
    memory_total: int | None
    bar1_total: int | None
    persistence: bool | None
    ecc_enabled: bool | None
    ecc_pending: bool | None
    ecc_uncorrected: int | None
    sm_clock_mhz: int | None
    sm_clock_max_mhz: int | None
    slowdowns: list[str] | None
    pcie_gen: int | None
    pcie_width: int | None
    pcie_gen_max: int | None  # what the GPU and the slot together can reach
    pcie_gen_gpu_max: int | None  # what the GPU alone can reach
    pcie_width_max: int | None
    nvlinks_active: int | None  # links up; None where NVML does not support NVLink queries


@dataclass(frozen=True)
class HostFacts:
    """The driver, each GPU's settings, and every GPU pair's P2P status and common ancestor."""

    driver_version: str | None
    cuda_driver_version: str | None  # the newest CUDA the driver runs: "13.0"
    gpus: list[GpuFacts]
    pairs: list[dict]  # {"a", "b", "p2p": "OK" | reason | None, "link": "NVLink" | "PIX"... | None}


def host_facts() -> HostFacts:
    """Read what the doctor checks, every field on its own (a refused one is None); raises NvmlUnavailable."""
    nvml = _nvml()
    cuda = _read(pynvml.nvmlSystemGetCudaDriverVersion)
    gpus = [_gpu_facts(i, h) for i, h in enumerate(nvml.handles)]
    pairs = []
    for a in range(len(nvml.handles)):
        for b in range(a + 1, len(nvml.handles)):
            ha, hb = nvml.handles[a], nvml.handles[b]
            status = _read(lambda: pynvml.nvmlDeviceGetP2PStatus(ha, hb, P2P_CAPS_INDEX_READ))
            nvlink = _read(lambda: pynvml.nvmlDeviceGetP2PStatus(ha, hb, 2))  # NVML_P2P_CAPS_INDEX_NVLINK
            level = _read(lambda: pynvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
            link = "NVLink" if nvlink == 0 and (gpus[a].nvlinks_active or 0) > 0 else TOPOLOGY_LEVELS.get(level)
            pairs.append({"a": a, "b": b, "p2p": None if status is None else P2P_STATUS.get(status, f"status {status}"),
                          "link": link})
    return HostFacts(driver_version=_read(lambda: _text(pynvml.nvmlSystemGetDriverVersion())),
                     cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None, gpus=gpus, pairs=pairs)


def _gpu_facts(index: int, h) -> GpuFacts:
    memory = _read(lambda: _memory_info(h))
    ecc = _read(lambda: pynvml.nvmlDeviceGetEccMode(h))
    reasons = _read(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))
    pci = _read(lambda: pynvml.nvmlDeviceGetPciInfo(h))
    links = None
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = _read(lambda: pynvml.nvmlDeviceGetNvLinkState(h, link))
        if state is None:
            break  # NotSupported (a PCIe card) or past the GPU's last link
        links = (links or 0) + (state == pynvml.NVML_FEATURE_ENABLED)
    return GpuFacts(
        index=index, name=_read(lambda: _text(pynvml.nvmlDeviceGetName(h))),
        pci_bus_id=_pci_bus_id(pci), memory_total=memory.total if memory is not None else None,
        bar1_total=_read(lambda: pynvml.nvmlDeviceGetBAR1MemoryInfo(h).bar1Total),
        persistence=_flag(_read(lambda: pynvml.nvmlDeviceGetPersistenceMode(h))),
        ecc_enabled=_flag(ecc[0]) if ecc else None, ecc_pending=_flag(ecc[1]) if ecc else None,
        ecc_uncorrected=_read(lambda: _ecc_errors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)),
        sm_clock_mhz=_read(lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
        sm_clock_max_mhz=_read(lambda: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
        slowdowns=None if reasons is None else [name for bit, name in SLOWDOWN_REASONS.items() if reasons & bit],
        pcie_gen=_read(lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        pcie_width=_read(lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
        pcie_gen_max=_read(lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        pcie_gen_gpu_max=_read(lambda: pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration(h)),
        pcie_width_max=_read(lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
        nvlinks_active=links)


def _flag(value) -> bool | None:
    return None if value is None else value == pynvml.NVML_FEATURE_ENABLED


def _pci_bus_id(pci) -> str | None:
    """NVML's "00000000:18:00.0" as sysfs writes it: "0000:18:00.0"."""
    if pci is None:
        return None
    bus = _text(pci.busId).lower()
    return bus[-12:] if len(bus) >= 12 else bus
