"""The NVML sampler against the NVML double (tests/nvmldouble.py), which speaks pynvml's names and shapes."""

import pynvml
import pytest

from deployments.host import gpu, gpuwait
from tests.nvmldouble import GIB, MIB, RESERVED, TOTAL, FakeGpu, FakeNvml, proc


@pytest.fixture
def fake(monkeypatch):
    fake = FakeNvml([
        FakeGpu("GPU-aaaa", procs=[proc(4242, 8 * GIB)]),
        FakeGpu("GPU-bbbb"),
    ])
    fake.names[4242] = "python3"
    lacking = [n for n in vars(FakeNvml) if not n.startswith("_") and not hasattr(pynvml, n)]
    assert not lacking, f"the fake offers names real pynvml lacks: {lacking}"
    monkeypatch.setattr(gpu, "pynvml", fake)
    monkeypatch.setattr(gpu, "_session", None)
    return fake


def test_inventory_names_each_gpu_with_its_size_and_compute_capability(fake):
    assert gpu.inventory() == [
        gpu.GpuInfo(0, "GPU-aaaa", "NVIDIA H200", 143771 * MIB, "9.0"),
        gpu.GpuInfo(1, "GPU-bbbb", "NVIDIA H200", 143771 * MIB, "9.0"),
    ]


def test_sample_reads_every_figure_of_every_gpu_in_plain_units(fake):
    first, second = gpu.sample()

    assert first == gpu.GpuSample(
        index=0, uuid="GPU-aaaa", memory_total=143771 * MIB, memory_used=20 * GIB,
        memory_free=143771 * MIB - 20 * GIB - 512 * MIB, util_gpu=87, util_memory=41,
        temperature_c=54, power_w=412.345, power_limit_w=700.0, sm_clock_mhz=1980,
        pcie_gen=5, pcie_width=16,
        processes=[gpu.GpuProcess(pid=4242, used_memory=8 * GIB, name="python3")],
        ecc_sbe_volatile=3, ecc_dbe_volatile=0,
    )
    assert second.uuid == "GPU-bbbb" and second.processes == []


def test_sample_of_chosen_gpus_reads_only_those(fake):
    assert [s.uuid for s in gpu.sample([1])] == ["GPU-bbbb"]


@pytest.mark.parametrize("error", [
    pynvml.NVMLError_NotSupported, pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_Unknown,
])
def test_a_figure_the_driver_refuses_reads_as_unknown_and_the_rest_still_arrives(fake, error):
    fake.gpus[0].fails = {"nvmlDeviceGetTemperature": error, "nvmlDeviceGetPowerUsage": error,
                          "nvmlDeviceGetCurrPcieLinkWidth": error, "nvmlDeviceGetTotalEccErrors": error}

    first, second = gpu.sample()

    assert (first.temperature_c, first.power_w, first.pcie_width) == (None, None, None)
    assert (first.ecc_sbe_volatile, first.ecc_dbe_volatile) == (None, None)  # a GPU without ECC
    assert (first.memory_used, first.util_gpu, first.power_limit_w) == (20 * GIB, 87, 700.0)
    assert (second.temperature_c, second.power_w, second.pcie_width) == (54, 412.345, 16)


def test_a_new_power_limit_shows_once_the_cached_one_expires(fake, monkeypatch):
    gpu.sample()
    fake.gpus[0].limit_mw = 450_000
    assert gpu.sample()[0].power_limit_w == 700.0

    monkeypatch.setattr(gpu, "POWER_LIMIT_TTL_S", 0)
    assert gpu.sample()[0].power_limit_w == 450.0


def test_on_drivers_without_the_v2_call_used_memory_includes_the_reserved_memory_as_their_nvidia_smi_shows(fake):
    # v1 has no reserved field: its used is the reserved and the allocated memory together (total = used + free),
    # the figure nvidia-smi shows on such a driver; v2 (the second GPU) says how much of it is reserved.
    fake.gpus[0].fails = {"nvmlDeviceGetMemoryInfo_v2": pynvml.NVMLError_FunctionNotFound}

    v1, v2 = gpu.sample()

    assert (v1.memory_total, v1.memory_used, v1.memory_free) == (TOTAL, RESERVED + 20 * GIB, TOTAL - RESERVED - 20 * GIB)
    assert (v2.memory_total, v2.memory_used, v2.memory_free) == (TOTAL, 20 * GIB, v1.memory_free)


def test_processes_the_driver_cannot_list_read_as_unknown_not_as_none_running(fake):
    fake.gpus[0].fails = {"nvmlDeviceGetComputeRunningProcesses": pynvml.NVMLError_NotSupported,
                          "nvmlDeviceGetGraphicsRunningProcesses": pynvml.NVMLError_NotSupported}

    assert gpu.sample()[0].processes is None


def test_compute_and_graphics_processes_are_merged_by_pid(fake):
    fake.gpus[1].compute = [proc(10, 2 * GIB), proc(11, None)]
    fake.gpus[1].graphics = [proc(10, 2 * GIB), proc(12, 300 * MIB)]

    procs = gpu.processes_on([1])[1]

    assert {p.pid: p.used_memory for p in procs} == {10: 2 * GIB, 11: None, 12: 300 * MIB}
    assert [p.pid for p in procs if p.graphics] == [12]  # graphics only: a display server's kind ("C+G" is not)


@pytest.mark.parametrize("error, reason", [
    (pynvml.NVMLError_LibraryNotFound, "NVML Shared Library Not Found"),
    (pynvml.NVMLError_DriverNotLoaded, "Driver Not Loaded"),
])
def test_a_node_without_nvidia_driver_says_no_gpu_and_why(fake, error, reason):
    fake.init_error = error

    with pytest.raises(gpu.NvmlUnavailable) as caught:
        gpu.sample()

    assert str(caught.value) == f"no NVIDIA GPU on this node: {reason}"
    assert caught.value.permanent


def test_nvml_starts_once_and_later_samples_reuse_it(fake):
    gpu.inventory()
    for _ in range(3):
        gpu.sample()

    assert fake.inits == 1


def test_wait_memory_released_returns_once_the_killed_process_is_gone(fake):
    fake.gpus[0].exits_after[4242] = 3

    gpuwait.wait_memory_released([0], [4242], timeout_s=5, poll_s=0.001)

    assert gpu.processes_on([0]) == {0: []}


def test_wait_memory_released_times_out_naming_the_pids_and_gib_still_held(fake):
    fake.gpus[1].compute = [proc(4242, 2 * GIB), proc(77, GIB // 2)]

    with pytest.raises(gpu.MemoryNotReleased) as caught:
        gpuwait.wait_memory_released([0, 1], [4242, 77], timeout_s=0.05, poll_s=0.01)

    assert caught.value.pids_still_holding == {4242: 10 * GIB, 77: GIB // 2}
    assert str(caught.value) == (
        "GPU memory not released after 0.05 s: PID 77 holds 0.5 GiB, PID 4242 holds 10.0 GiB"
    )


def test_wait_memory_released_ignores_other_gpus_and_other_pids(fake):
    fake.gpus[1].compute = [proc(99, GIB)]

    gpuwait.wait_memory_released([0], [99], timeout_s=0)
    gpuwait.wait_memory_released([1], [4242], timeout_s=0)


def test_wait_memory_released_without_pids_waits_for_every_process(fake):
    fake.gpus[1].compute = [proc(99, None)]

    with pytest.raises(gpu.MemoryNotReleased, match="PID 99 holds an unknown amount"):
        gpuwait.wait_memory_released([1], None, timeout_s=0)


def test_the_energy_counters_of_the_chosen_gpus_are_summed_and_unsupported_reads_none(fake):
    fake.gpus[0].energy_mj, fake.gpus[1].energy_mj = 5_000_000, 7_000_000
    assert gpu.energy_mj([0, 1]) == 12_000_000 and gpu.energy_mj([1]) == 7_000_000
    fake.gpus[1].fails["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVMLError_NotSupported
    assert gpu.energy_mj([0, 1]) is None  # a sum without one GPU would read low


def test_the_energy_meter_gives_a_windows_joules_between_its_readings():
    counter = {"mj": 0}
    meter = gpu.EnergyMeter([0, 1], read=lambda indices: counter["mj"])
    for t, mj in ((0.0, 0), (1.0, 400_000), (2.0, 1_200_000), (4.0, 2_000_000)):
        counter["mj"] = mj
        meter.read(now=t)
    assert meter.joules(1.0, 2.0) == 800.0  # between two readings
    assert meter.joules(0.5, 3.0) == 1600.0 - 200.0  # 200 J at 0.5 s, 1,600 J at 3 s: interpolated
    assert meter.joules(3.0, 5.0) is None  # past the last reading: not covered
    unsupported = gpu.EnergyMeter([0], read=lambda indices: None)
    unsupported.read(now=0.0)
    unsupported.read(now=1.0)
    assert not unsupported.supported and unsupported.joules(0.0, 1.0) is None
    assert gpu.EnergyMeter([]).joules(0.0, 1.0) is None  # a CPU node: no GPUs, nothing read
