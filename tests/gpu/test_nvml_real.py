"""The sampler on a real NVIDIA GPU, checked against nvidia-smi and a real CUDA process."""

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from deployments.host import gpu, gpuwait

pytestmark = pytest.mark.gpu

MIB = 1024**2
GIB = 1024**3
ALLOC_GIB = 8
SMI_FIELDS = [
    "index", "uuid", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu",
    "power.draw", "power.limit", "clocks.sm", "pcie.link.gen.current", "pcie.link.width.current",
    "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
]
HOLDER = (
    "import time, torch\n"
    f"x = torch.ones({ALLOC_GIB} << 30, dtype=torch.uint8, device='cuda:0')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def nvidia_smi() -> list[dict]:
    """nvidia-smi's own reading of every GPU; numbers as floats, N/A as None."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    rows = []
    for line in filter(str.strip, out.splitlines()):
        row = dict(zip(SMI_FIELDS, (cell.strip() for cell in line.split(","))))
        for key, value in row.items():
            if key != "uuid":
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = None  # "[N/A]", "[Not Supported]"
        rows.append(row)
    return rows


def close(ours, theirs, tolerance) -> bool:
    """The sampler agrees with nvidia-smi. Where nvidia-smi has a figure the sampler must have one too
    (None would hide a lost field); only where nvidia-smi says N/A may it have none."""
    if theirs is None:
        return True
    return ours is not None and abs(ours - theirs) <= tolerance


def _settled(timeout_s: float = 60.0) -> None:
    """Until every GPU's power draw holds still (within 10 W over a second): right after a load (the energy check
    runs before this one) it falls by tens of watts a second, and two readers a moment apart differ by that much
    (seen on an H100: 371 W by the sampler, 437 W by nvidia-smi just before)."""
    deadline = time.monotonic() + timeout_s
    last = [g["power.draw"] for g in nvidia_smi()]
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = [g["power.draw"] for g in nvidia_smi()]
        if all(a is None or b is None or abs(a - b) <= 10 for a, b in zip(last, now)):
            return
        last = now


def test_sampler_figures_match_nvidia_smi(gpus):
    _settled()
    smi = nvidia_smi()
    samples = gpu.sample()

    assert len(samples) == len(smi) == len(gpus)
    for ours, theirs in zip(samples, smi):
        print(f"\nGPU {ours.index} {gpus[ours.index].name} cc {gpus[ours.index].compute_capability}")
        mib = {k: getattr(ours, k) and getattr(ours, k) / MIB
               for k in ("memory_total", "memory_used", "memory_free")}
        pairs = [
            ("memory.total MiB", mib["memory_total"], theirs["memory.total"], 0),
            ("memory.used MiB", mib["memory_used"], theirs["memory.used"], 64),
            ("utilization.gpu %", ours.util_gpu, theirs["utilization.gpu"], 15),
            ("temperature.gpu C", ours.temperature_c, theirs["temperature.gpu"], 3),
            ("power.draw W", ours.power_w, theirs["power.draw"],
             max(15, 0.1 * (theirs["power.draw"] or 0))),
            ("power.limit W", ours.power_limit_w, theirs["power.limit"], 1),
            ("clocks.sm MHz", ours.sm_clock_mhz, theirs["clocks.sm"],
             max(100, 0.15 * (theirs["clocks.sm"] or 0))),
            ("pcie gen", ours.pcie_gen, theirs["pcie.link.gen.current"], 0),
            ("pcie width", ours.pcie_width, theirs["pcie.link.width.current"], 0),
            ("ecc corrected", ours.ecc_sbe_volatile, theirs["ecc.errors.corrected.volatile.total"], 0),
            ("ecc uncorrected", ours.ecc_dbe_volatile, theirs["ecc.errors.uncorrected.volatile.total"], 0),
        ]
        for label, mine, smis, _ in pairs:
            print(f"  {label:<20} sampler {mine!s:>12}   nvidia-smi {smis!s:>12}")
        print(f"  memory free MiB      sampler {mib['memory_free']!s:>12}")
        assert ours.uuid == theirs["uuid"]
        assert ours.memory_total is not None and ours.memory_used is not None
        assert ours.memory_total // MIB == theirs["memory.total"]
        # ECC: both unknown on a GPU without it, both counts with it (/metrics leaves unknowns out).
        assert (ours.ecc_sbe_volatile is None) == (theirs["ecc.errors.corrected.volatile.total"] is None)
        off = [label for label, mine, smis, tol in pairs if not close(mine, smis, tol)]
        assert not off, f"sampler disagrees with nvidia-smi on {off} (None where nvidia-smi has a figure counts)"


@pytest.fixture
def holder(gpus):
    """A child process holding ALLOC_GIB of memory on GPU 0 until killed."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is needed to hold GPU memory")
    free = gpu.sample([0])[0].memory_free
    if free is not None and free < (ALLOC_GIB + 2) * GIB:
        pytest.skip(f"GPU 0 has only {free / GIB:.1f} GiB free")
    # Pin the child to NVML's GPU 0 whatever CUDA's own device order is.
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": gpus[0].uuid}
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        started = time.monotonic()
        readable, _, _ = select.select([child.stdout], [], [], 180)
        if not readable or child.stdout.readline().strip() != "ready":
            pytest.fail(f"the holder did not allocate its memory (exit code {child.poll()})")
        print(f"\nholder PID {child.pid} took {time.monotonic() - started:.1f} s "
              f"to hold {ALLOC_GIB} GiB")
        yield child
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_process_holding_gpu_memory_is_listed_with_its_pid_and_size(holder):
    procs = gpu.sample([0])[0].processes

    print(f"GPU 0 processes: {procs}")
    held = {p.pid: p.used_memory for p in procs or []}
    assert holder.pid in held, f"PID {holder.pid} not among NVML's PIDs {sorted(held)}"
    assert held[holder.pid] >= ALLOC_GIB * GIB


def test_memory_of_a_killed_process_comes_back_and_the_wait_sees_it(holder):
    before = gpu.sample([0])[0].memory_free

    started = time.monotonic()
    os.kill(holder.pid, signal.SIGKILL)
    gpuwait.wait_memory_released([0], [holder.pid], timeout_s=30)
    took = time.monotonic() - started

    after = gpu.sample([0])[0].memory_free
    print(f"\nSIGKILL to released: {took:.3f} s; free {before / GIB:.1f} -> {after / GIB:.1f} GiB")
    assert after - before >= ALLOC_GIB * GIB


def test_wait_times_out_naming_the_pid_of_a_process_still_alive(holder, monkeypatch):
    reads, real_read = [], gpu.processes_on
    monkeypatch.setattr(gpu, "processes_on", lambda indices: reads.append(1) or real_read(indices))
    started = time.monotonic()
    with pytest.raises(gpu.MemoryNotReleased) as caught:
        gpuwait.wait_memory_released([0], [holder.pid], timeout_s=1.0, poll_s=0.2)
    took = time.monotonic() - started

    print(f"\n{caught.value} (raised after {took:.2f} s, {len(reads)} reads)")
    assert caught.value.pids_still_holding[holder.pid] >= ALLOC_GIB * GIB
    assert f"PID {holder.pid} holds" in str(caught.value)
    # Relations, not a stopwatch: it waited out its timeout, and stopped polling once past it
    # (one read at the start, then one each 0.2 s until the deadline: at most 1.0 / 0.2 + 1 reads).
    assert took >= 1.0
    assert 2 <= len(reads) <= 6
