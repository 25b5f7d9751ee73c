"""The host doctor's NVML checks on a real NVIDIA GPU, checked against nvidia-smi's own answers:
driver and CUDA versions, persistence, ECC, clocks, PCIe, BAR1, and P2P per pair where the host has several GPUs."""
import re
import subprocess

import pytest

from deployments.host import doctor, gpu

pytestmark = pytest.mark.gpu
MIB = 1024**2


def smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True, timeout=60).stdout


def query(fields: list[str]) -> list[dict]:
    out = smi(f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits")
    return [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in out.strip().splitlines()]


@pytest.fixture(scope="module")
def facts():
    return gpu.host_facts()


def test_driver_and_cuda_versions_match_nvidia_smi(facts):
    assert facts.driver_version == query(["driver_version"])[0]["driver_version"]
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", smi()).group(1)
    assert facts.cuda_driver_version == cuda


def test_each_gpus_settings_match_nvidia_smi(facts):
    fields = ["index", "pci.bus_id", "persistence_mode", "ecc.mode.current", "clocks.max.sm", "pcie.link.gen.max",
              "pcie.link.width.max", "pcie.link.width.current"]
    rows = query(fields)
    assert len(rows) == len(facts.gpus)
    for row, g in zip(rows, facts.gpus):
        assert g.pci_bus_id == row["pci.bus_id"].lower()[-12:]
        assert g.persistence == (row["persistence_mode"] == "Enabled")
        if row["ecc.mode.current"] in ("Enabled", "Disabled"):
            assert g.ecc_enabled == (row["ecc.mode.current"] == "Enabled")
        assert g.sm_clock_max_mhz == int(row["clocks.max.sm"])
        assert g.pcie_gen_max == int(row["pcie.link.gen.max"])
        assert g.pcie_width_max == int(row["pcie.link.width.max"])
        assert g.pcie_width == int(row["pcie.link.width.current"])
        assert g.slowdowns is not None and g.ecc_uncorrected is not None


def test_bar1_size_matches_nvidia_smi(facts):
    text = smi("-q", "-d", "MEMORY")
    totals = [int(m) for m in re.findall(r"BAR1 Memory Usage\s*\n\s*Total\s*:\s*(\d+) MiB", text)]
    assert [g.bar1_total // MIB for g in facts.gpus] == totals


def test_p2p_per_pair_matches_nvidia_smi(facts):
    if len(facts.gpus) < 2:
        assert facts.pairs == [] and doctor.p2p_check(facts).status == doctor.PASS
        return
    # nvidia-smi topo -p2p r: a matrix of OK / CNS / GNS / TNS / NS / U per pair.
    matrix = [line.split() for line in smi("topo", "-p2p", "r").splitlines() if line.strip().startswith("GPU")]
    for pair in facts.pairs:
        shown = matrix[pair["a"]][1 + pair["b"]]
        assert (pair["p2p"] == "OK") == (shown == "OK"), (pair, shown)


def test_every_check_runs_on_this_host_and_each_problem_has_a_fix(facts, tmp_path):
    import torch

    checks = doctor.run(root="/", facts=facts, engine_cuda=torch.version.cuda, disk_path=str(tmp_path))
    by_name = {c.name: c for c in checks}
    assert set(by_name) == {"driver", "topology", "p2p", "pcie", "bar", "persistence", "ecc", "clocks", "iommu",
                            "acs", "uvm_hmm", "disk"}
    assert by_name["driver"].status == doctor.PASS, by_name["driver"]  # this torch runs here, so its CUDA must
    for check in checks:
        assert check.status in (doctor.PASS, doctor.WARN, doctor.FAIL, doctor.UNKNOWN)
        if check.status in (doctor.WARN, doctor.FAIL):
            assert check.fix, check
    for check in checks:  # the report the lead reads off the run
        print(f"doctor {check.name}: {check.status}: {check.summary}")
