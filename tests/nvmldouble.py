"""The NVML double: a stand-in for NVIDIA's pynvml with its function names, return shapes and error classes.

The sampler's unit tests (tests/host/) and the simulated fleet (tests/fleetsim.py) put a FakeNvml in the place of
deployments.host.gpu's pynvml; a real node agent process gets one through tests/e2e/nvml_double/pynvml.py, driven by a
SharedMemory that the test writes and reads back (tests/e2e/test_node_page.py).
"""
import inspect
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml

MIB = 1024**2
GIB = 1024**3
TOTAL = 143771 * MIB  # an H200's memory as NVML reports it
RESERVED = 512 * MIB  # what the driver and firmware set aside


class FakeGpu:
    """One GPU as the fake driver sees it; `fails` maps a pynvml function name to its error.

    `graphics`: graphics processes (a display server: Xorg, gnome-shell), listed by
    nvmlDeviceGetGraphicsRunningProcesses only. With `drain_s`, the GPU's used memory is `used` plus what its
    processes hold, and a process that exits leaves the lists at once while its memory comes back over `drain_s`
    seconds, evenly: a wait that only watches the lists ends before the memory is free. (A real H100, driver 580,
    had the memory back by the time a SIGKILLed holder was reaped: the drain is the pessimistic case.)"""

    def __init__(self, uuid, procs=(), graphics=(), fails=None, drain_s=None, total=TOTAL, name="NVIDIA H200",
                 capability=(9, 0)):
        self.uuid, self.total, self.name, self.capability = uuid, total, name, tuple(capability)
        self.compute = list(procs)
        self.graphics = list(graphics)
        self.fails = dict(fails or {})
        self.exits_after: dict[int, int] = {}  # pid -> process-list reads before it is gone
        self.used = 20 * GIB  # allocated memory, the driver's reserved memory not included
        self.limit_mw = 700_000
        self.energy_mj = 0  # the driver's energy counter
        self.drain_s = drain_s
        self.draining: list[tuple[float, int]] = []  # (when a process exited, the bytes it held)

    def check(self, function):
        if function in self.fails:
            raise self.fails[function]()

    def exit(self, pid):
        """Process `pid` ends: gone from both lists now, its memory back over `drain_s`."""
        held = {p.pid: p.usedGpuMemory or 0 for p in [*self.compute, *self.graphics]}
        self.compute = [p for p in self.compute if p.pid != pid]
        self.graphics = [p for p in self.graphics if p.pid != pid]
        if self.drain_s is not None and held.get(pid):
            self.draining.append((time.monotonic(), held[pid]))

    def allocated(self) -> int:
        """The used memory NVML reports (the driver's reserve apart)."""
        if self.drain_s is None:
            return self.used
        held = {p.pid: p.usedGpuMemory or 0 for p in [*self.compute, *self.graphics]}
        now = time.monotonic()
        left = sum(int(b * max(0.0, 1 - (now - t) / self.drain_s)) if self.drain_s else 0 for t, b in self.draining)
        return self.used + sum(held.values()) + left


def proc(pid, used):
    return SimpleNamespace(pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF,
                           computeInstanceId=0xFFFFFFFF)


class FakeNvml:
    """Stands in for the pynvml module: same function names, return shapes and error classes. With `shared`, each
    GPU's allocated memory comes from another process at every read, and every read is recorded there."""

    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_MEMORY_ERROR_TYPE_CORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, gpus, init_error=None, shared=None):
        self.gpus = gpus
        self.init_error = init_error
        self.shared = shared
        self.inits = 0
        self.names = {}

    def nvmlInit(self):
        self.inits += 1
        if self.init_error:
            raise self.init_error()

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, h):
        h.check("nvmlDeviceGetUUID")
        return h.uuid

    def nvmlDeviceGetName(self, h):
        h.check("nvmlDeviceGetName")
        return h.name

    def nvmlDeviceGetCudaComputeCapability(self, h):
        h.check("nvmlDeviceGetCudaComputeCapability")
        return h.capability

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        h.check("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo")
        index = self.gpus.index(h)
        if self.shared is not None:
            h.used = self.shared.used(index)
        used = h.allocated()
        free = h.total - used - RESERVED
        if version:  # v2 counts the reserved memory apart: total = reserved + used + free
            info = SimpleNamespace(version=version, total=h.total, reserved=RESERVED, used=used, free=free)
        else:  # v1's used is the reserved and the allocated memory together: total = used + free
            info = SimpleNamespace(total=h.total, used=RESERVED + used, free=free)
        if self.shared is not None:
            self.shared.record(index, info.used, 2 if version else 1)
        return info

    def nvmlDeviceGetUtilizationRates(self, h):
        h.check("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        h.check("nvmlDeviceGetTemperature")
        return 54

    def nvmlDeviceGetPowerUsage(self, h):
        h.check("nvmlDeviceGetPowerUsage")
        return 412_345  # milliwatts

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        h.check("nvmlDeviceGetTotalEnergyConsumption")
        return h.energy_mj

    def nvmlDeviceGetPowerManagementLimit(self, h):
        h.check("nvmlDeviceGetPowerManagementLimit")
        return h.limit_mw

    def nvmlDeviceGetClockInfo(self, h, clock):
        assert clock == pynvml.NVML_CLOCK_SM
        h.check("nvmlDeviceGetClockInfo")
        return 1980

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        h.check("nvmlDeviceGetTotalEccErrors")
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        return 3 if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        h.check("nvmlDeviceGetCurrPcieLinkGeneration")
        return 5

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        h.check("nvmlDeviceGetCurrPcieLinkWidth")
        return 16

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        h.check("nvmlDeviceGetComputeRunningProcesses")
        for pid in list(h.exits_after):
            h.exits_after[pid] -= 1
            if h.exits_after[pid] < 0:
                h.exit(pid)
                del h.exits_after[pid]
        return list(h.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        h.check("nvmlDeviceGetGraphicsRunningProcesses")
        return list(h.graphics)

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise pynvml.NVMLError_NotFound()
        return self.names[pid]


class SharedMemory:
    """GPU memory set by a test for a double in another process, through two files in `folder`.

    `state.json` (the test writes it): each GPU's allocated bytes, and how many of the agent's samples the driver
    answers in all (`turns`; None: any number). A sample's first read is GPU 0's memory, made inside the agent's
    own `Agent.sample` (deployments/agent.py); past the turns allowed it waits until the test allows more, so the
    test lets the agent take exactly the samples it wants, and a sample waiting means every earlier one was sent.
    Other reads (the inventory at start, the host checks, the search for GPU processes nobody owns, which samples
    NVML again every few seconds) are answered at once.
    `reported.jsonl` (the double appends to it): one line per memory read with what it answered
    (`{"gpu", "used", "v", "sample"}`: the struct's version, whether the agent's sample made the read), and
    `{"waiting": turn}` when a sample starts waiting.
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        self.state, self.log = self.folder / "state.json", self.folder / "reported.jsonl"
        self._turns_taken = 0  # only the agent's sampler thread takes turns

    # The test's side.

    def set(self, used: list[int], turns: int | None = None) -> None:
        """Each GPU's allocated bytes from now on, and how many of the agent's samples are answered in all."""
        self.folder.mkdir(parents=True, exist_ok=True)
        part = self.state.with_suffix(".part")
        part.write_text(json.dumps({"used": used, "turns": turns}))
        os.replace(part, self.state)  # the double never reads half a file

    def entries(self) -> list[dict]:
        if not self.log.exists():
            return []
        entries = []
        for line in self.log.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except ValueError:  # the line the double is writing now
                break
        return entries

    def reported(self, index: int) -> list[int]:
        """The used bytes the double answered the agent's samples for GPU `index` (v2 reads, as the sampler makes
        them), in order: what the agent can have sent to browsers."""
        return [e["used"] for e in self.entries() if e.get("gpu") == index and e["sample"] and e["v"] == 2]

    def waiting(self) -> int | None:
        """The turn the agent's sample waits for, once one waits: the samples answered so far are one fewer."""
        waits = [e["waiting"] for e in self.entries() if "waiting" in e]
        return waits[-1] if waits else None

    # The double's side.

    def used(self, index: int) -> int:
        state = json.loads(self.state.read_text())
        if index == 0 and _in_agent_sample():
            state = self._turn(state)
        return state["used"][index]

    def _turn(self, state: dict) -> dict:
        said = False
        while state["turns"] is not None and self._turns_taken >= state["turns"]:
            if not said:
                self._append({"waiting": self._turns_taken + 1})
                said = True
            time.sleep(0.01)
            state = json.loads(self.state.read_text())
        self._turns_taken += 1
        return state

    def record(self, index: int, used: int, version: int) -> None:
        self._append({"gpu": index, "used": used, "v": version, "sample": _in_agent_sample()})

    def _append(self, entry: dict) -> None:
        with open(self.log, "a") as f:
            f.write(json.dumps(entry) + "\n")


def _in_agent_sample() -> bool:
    """Whether this read is made inside the node agent's own sample (deployments.agent.Agent.sample)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_qualname == "Agent.sample" and frame.f_globals.get("__name__") == "deployments.agent":
            return True
        frame = frame.f_back
    return False


def agent_double(folder, gpus: int = 8) -> FakeNvml:
    """The double a real agent process samples: `gpus` H200s whose memory a SharedMemory in `folder` sets; where
    `folder` holds a gpus.json (write_model), the GPUs it names: count, name, memory, compute capability and
    graphics processes (a display server)."""
    spec = json.loads((Path(folder) / "gpus.json").read_text()) if (Path(folder) / "gpus.json").exists() else {}
    made = [FakeGpu(f"GPU-double-{i}", total=spec.get("total_mib", TOTAL // MIB) * MIB, name=spec.get("name", "NVIDIA H200"),
                    capability=spec.get("capability", (9, 0)),
                    graphics=[proc(pid, mib * MIB) for pid, mib, *_ in spec.get("graphics", {}).get(str(i), [])])
            for i in range(spec.get("count", gpus))]
    double = FakeNvml(made, shared=SharedMemory(folder))
    # NVML names a process by its executable's path (nvmlSystemGetProcessName): "/usr/lib/xorg/Xorg".
    double.names = {pid: rest[0] for listed in spec.get("graphics", {}).values() for pid, _, *rest in listed if rest}
    return double


def write_model(folder, count: int, name: str, total_mib: int, capability: tuple, graphics: dict | None = None) -> None:
    """The GPUs agent_double gives an agent whose NVML_DOUBLE is `folder`; `graphics`: {index: [(pid, MiB, the name
    NVML gives it)]}."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "gpus.json").write_text(json.dumps({"count": count, "name": name, "total_mib": total_mib,
                                                         "capability": list(capability),
                                                         "graphics": {str(k): v for k, v in (graphics or {}).items()}}))


def install(module, double: FakeNvml) -> None:
    """Answer every NVML call of NVIDIA's pynvml `module` with the double's, NotSupported where it has none (the
    host doctor's reads), so that the product imports pynvml as it does on a GPU host."""
    for name, value in list(vars(module).items()):
        if name.startswith("nvml") and inspect.isfunction(value):
            setattr(module, name, getattr(double, name, None) or _not_supported(module))


def _not_supported(module):
    def refuse(*args, **kwargs):
        raise module.NVMLError(module.NVML_ERROR_NOT_SUPPORTED)

    return refuse
