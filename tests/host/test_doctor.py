"""The host doctor: NVML facts against a fake pynvml that speaks pynvml's names, every /sys and
/proc check on fixture trees written here."""
from types import SimpleNamespace

import pynvml
import pytest

from deployments.host import doctor, gpu
from tests.nvmldouble import GIB, MIB, FakeGpu, FakeNvml


class DoctorGpu(FakeGpu):
    def __init__(self, uuid, bus, **settings):
        super().__init__(uuid)
        self.bus = bus
        self.persistence, self.ecc, self.reasons, self.bar1 = 1, (1, 1), 0, 256 * GIB
        self.width, self.width_max, self.gen_max, self.gen_gpu_max, self.uncorrected = 16, 16, 5, 5, 0
        self.__dict__.update(settings)


class DoctorNvml(FakeNvml):
    """FakeNvml plus what the doctor reads; `p2p` maps a pair (a, b) to its NVML P2P status (0 = OK)."""

    NVML_P2P_CAPS_INDEX_READ = pynvml.NVML_P2P_CAPS_INDEX_READ
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_FEATURE_ENABLED = pynvml.NVML_FEATURE_ENABLED

    def __init__(self, gpus, p2p=None, cuda=13000):
        super().__init__(gpus)
        self.p2p, self.cuda = dict(p2p or {}), cuda

    def nvmlSystemGetDriverVersion(self):
        return "580.95.05"

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"0000{h.bus}".encode())

    def nvmlDeviceGetBAR1MemoryInfo(self, h):
        return SimpleNamespace(bar1Total=h.bar1, bar1Used=0, bar1Free=h.bar1)

    def nvmlDeviceGetPersistenceMode(self, h):
        return h.persistence

    def nvmlDeviceGetEccMode(self, h):
        return list(h.ecc)

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        return h.uncorrected if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return 1980

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return h.reasons

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return h.width

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return h.width_max

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return h.gen_max

    def nvmlDeviceGetGpuMaxPcieLinkGeneration(self, h):
        return h.gen_gpu_max

    def nvmlDeviceGetNvLinkState(self, h, link):
        raise pynvml.NVMLError_NotSupported()  # a PCIe card, as the borrowed H200 answered (FACTS.md)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index in (0, 2), "the caps index must be a plain int (pynvml's READ constant is a tuple)"
        if index == 2:
            return 5  # no NVLink
        pair = (self.gpus.index(a), self.gpus.index(b))
        return self.p2p.get(pair, 0)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return pynvml.NVML_TOPOLOGY_HOSTBRIDGE


def install(monkeypatch, fake):
    lacking = [n for n in vars(DoctorNvml) if not n.startswith("_") and not hasattr(pynvml, n)]
    assert not lacking, f"the fake offers names real pynvml lacks: {lacking}"
    monkeypatch.setattr(gpu, "pynvml", fake)
    monkeypatch.setattr(gpu, "_session", None)
    return gpu.host_facts()


def four_gpus(**settings):
    return [DoctorGpu(f"GPU-{i}", f":{0x18 + i:02x}:00.0", **settings) for i in range(4)]


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_pcie_host_passes_every_nvml_check(monkeypatch):
    facts = install(monkeypatch, DoctorNvml(four_gpus()))
    assert (facts.driver_version, facts.cuda_driver_version) == ("580.95.05", "13.0")
    assert facts.gpus[1].pci_bus_id == "0000:19:00.0"
    checks = by_name(doctor.run(root="/nonexistent", facts=facts, engine_cuda="12.9"))
    for name in ("driver", "topology", "p2p", "pcie", "bar", "persistence", "ecc", "clocks"):
        assert checks[name].status == doctor.PASS, checks[name]
    assert checks["topology"].data["kind"] == "PCIe" and "PHB" in checks["topology"].summary
    assert doctor.nccl_presets("PCIe", True)[0]["name"] == "PCIe, low concurrency"


def test_p2p_off_between_pairs_fails_with_the_pairs_named(monkeypatch):
    facts = install(monkeypatch, DoctorNvml(four_gpus(), p2p={(0, 1): 1, (2, 3): 4}))
    p2p = doctor.p2p_check(facts)
    assert p2p.status == doctor.FAIL
    assert "2 of 6 GPU pairs: 0-1 (chipset not supported), 2-3 (disabled by regkey)" in p2p.summary
    assert "NCCL_P2P_DISABLE=1" in p2p.fix
    # Where P2P is off only the P2P-free preset is offered.
    assert [p["env"].get("NCCL_P2P_DISABLE") for p in doctor.nccl_presets("PCIe", False)] == ["1"]


def test_each_nvml_setting_that_breaks_or_slows_an_engine_warns_or_fails(monkeypatch):
    gpus = four_gpus()
    gpus[0].width = 8
    gpus[1].persistence = 0
    gpus[2].uncorrected = 2
    gpus[3].reasons = 0x40
    gpus[3].bar1 = 256 * MIB
    facts = install(monkeypatch, DoctorNvml(gpus, cuda=12080))
    checks = by_name(doctor.run(root="/nonexistent", facts=facts, engine_cuda="12.9"))
    assert (checks["driver"].status, checks["driver"].fix) == (doctor.FAIL, "install NVIDIA driver 575+ (CUDA 12.9), "
                                                               "or an engine built for CUDA 12.8")
    assert checks["pcie"].status == doctor.FAIL and "x8 of x16" in checks["pcie"].summary
    assert checks["persistence"].status == doctor.WARN and "nvidia-smi -pm 1" in checks["persistence"].fix
    assert checks["ecc"].status == doctor.FAIL and "2 uncorrected" in checks["ecc"].summary
    assert checks["clocks"].status == doctor.WARN and "HW thermal slowdown" in checks["clocks"].summary
    assert checks["bar"].status == doctor.WARN and "Resizable BAR" in checks["bar"].fix
    assert all(c.fix for c in checks.values() if c.status in (doctor.WARN, doctor.FAIL))


def test_a_host_without_nvml_says_so_and_still_checks_the_rest(tmp_path):
    checks = by_name(doctor.run(root=str(tmp_path), facts=None, nvml_error="NVML Shared Library Not Found",
                                disk_path=str(tmp_path)))
    assert checks["driver"].status == doctor.UNKNOWN and "NVML Shared Library Not Found" in checks["driver"].summary
    assert "p2p" not in checks and checks["uvm_hmm"].status == doctor.PASS and checks["disk"].status == doctor.PASS


# --- /sys and /proc on fixture trees ---------------------------------------------------------------------------

def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)


def bridge_config(acs_control: int | None) -> bytes:
    """4096 bytes of a bridge's config space: an AER capability at 0x100, then ACS (id 0x0D) at 0x148."""
    config = bytearray(4096)
    config[0x100:0x104] = (0x0001 | (1 << 16) | ((0x148 if acs_control is not None else 0) << 20)).to_bytes(4, "little")
    if acs_control is not None:
        config[0x148:0x14C] = (0x000D | (1 << 16)).to_bytes(4, "little")
        config[0x14C:0x14E] = (0x5F).to_bytes(2, "little")  # capability register
        config[0x14E:0x150] = acs_control.to_bytes(2, "little")
    return bytes(config)


def test_uvm_hmm_setting_from_the_module_parameter(tmp_path):
    assert doctor.uvm_check(str(tmp_path), True).status == doctor.WARN  # not loaded
    write(tmp_path, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "N\n")
    off = doctor.uvm_check(str(tmp_path), True)
    assert off.status == doctor.FAIL and "uvm_disable_hmm=1" in off.fix
    assert doctor.uvm_check(str(tmp_path), True, multi_gpu=False).status == doctor.WARN  # one GPU: no NCCL between GPUs
    write(tmp_path, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm", "Y\n")
    assert doctor.uvm_check(str(tmp_path), True).status == doctor.PASS


def test_iommu_translating_warns_on_multi_gpu_and_passthrough_passes(tmp_path):
    assert doctor.iommu_check(str(tmp_path), True).summary == "IOMMU off"
    for group in range(3):
        (tmp_path / f"sys/kernel/iommu_groups/{group}/devices").mkdir(parents=True)
    write(tmp_path, "proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on\n")
    on = doctor.iommu_check(str(tmp_path), True)
    assert on.status == doctor.WARN and "iommu=pt" in on.fix and "3 groups" in on.summary
    assert doctor.iommu_check(str(tmp_path), False).status == doctor.PASS  # one GPU: no P2P to hang
    write(tmp_path, "proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on iommu=pt\n")
    assert doctor.iommu_check(str(tmp_path), True).status == doctor.PASS


def test_acs_redirect_on_a_bridge_is_found_in_its_config_space(tmp_path):
    devices = tmp_path / "sys/bus/pci/devices"
    write(devices, "0000:17:00.0/class", "0x060400\n")  # a switch port with ACS, redirect off
    write(devices, "0000:17:00.0/config", bridge_config(0x0001))
    write(devices, "0000:18:00.0/class", "0x030200\n")  # the GPU itself: not a bridge, not read
    write(devices, "0000:18:00.0/config", bridge_config(0x001D))
    assert doctor.acs_check(str(tmp_path), True).status == doctor.PASS
    write(devices, "0000:16:00.0/class", "0x060400\n")  # a bridge with Request and Completion Redirect on
    write(devices, "0000:16:00.0/config", bridge_config(0x000D))
    found = doctor.acs_check(str(tmp_path), True)
    assert found.status == doctor.WARN and found.data["redirecting"] == ["0000:16:00.0"]
    assert "P2P Request Redirect, P2P Completion Redirect" in found.summary and "setpci" in found.fix
    assert doctor.acs_control(bridge_config(None)) is None


def test_acs_needs_the_extended_config_space_and_a_vm_without_bridges_passes(tmp_path):
    write(tmp_path, "sys/bus/pci/devices/0000:00:05.0/class", "0x030200\n")  # a GPU passed into a VM, no bridge
    assert "no PCI bridge visible" in doctor.acs_check(str(tmp_path), True).summary
    write(tmp_path, "sys/bus/pci/devices/0000:16:00.0/class", "0x060400\n")
    write(tmp_path, "sys/bus/pci/devices/0000:16:00.0/config", bytes(256))  # what a non-root reader gets
    unread = doctor.acs_check(str(tmp_path), True)
    assert unread.status == doctor.UNKNOWN and "needs root" in unread.summary


def test_free_disk_against_the_largest_recipe(tmp_path):
    assert doctor.disk_check(str(tmp_path / "store"), 1 << 70, "Kimi-K2.5").status == doctor.WARN
    # A host without GPUs serves no recipe's model: said, not warned (a CPU VM was warned about GLM-5's 1,663 GiB).
    cpu = doctor.disk_check(str(tmp_path / "store"), 1 << 70, "Kimi-K2.5", gpu_host=False)
    assert cpu.status == doctor.PASS and "which a host without GPUs does not serve" in cpu.summary
    ok = doctor.disk_check(str(tmp_path), 1, "tiny")
    assert ok.status == doctor.PASS and "room for the largest recipe (tiny" in ok.summary


def test_engine_cuda_read_from_the_engines_torch_without_importing_it(tmp_path):
    write(tmp_path, "venv/bin/vllm", "#!/bin/sh\n")
    assert doctor.engine_cuda(str(tmp_path / "venv/bin/vllm")) is None
    write(tmp_path, "venv/lib/python3.12/site-packages/torch/version.py",
          "from typing import Optional\n__version__ = '2.14.0+cu129'\ncuda: Optional[str] = '12.9'\n")
    assert doctor.engine_cuda(str(tmp_path / "venv/bin/vllm")) == "12.9"
    write(tmp_path, "venv/lib/python3.12/site-packages/torch/version.py", "cuda: Optional[str] = None\n")
    assert doctor.engine_cuda(str(tmp_path / "venv/bin/vllm")) is None


@pytest.mark.parametrize("have, need, status", [("13.0", "12.9", doctor.PASS), ("12.8", "13.0", doctor.FAIL),
                                                 ("12.9", None, doctor.UNKNOWN)])
def test_driver_against_the_engines_cuda(have, need, status):
    facts = gpu.HostFacts("570.1", have, [], [])
    assert doctor.driver_check(facts, "", need).status == status
