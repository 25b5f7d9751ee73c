"""The host doctor's report: run on the node into Node.host_checks, shown on the node page, and
the deploy form's warning when a chosen layout depends on a failing check."""
from unittest import mock

import pytest
from django.urls import reverse

from deployments.host import doctor, gpu
from deployments.models import Node, Recipe
from deployments.services import doctor as doctor_service
from deployments.templatetags import hostchecks
from tests.factories import GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
GB = 10**9


def facts(p2p_off=False, gpus=2):
    one = dict(name="NVIDIA H200", memory_total=141 * GB, bar1_total=256 * 2**30, persistence=True, ecc_enabled=True,
               ecc_pending=True, ecc_uncorrected=0, sm_clock_mhz=1980, sm_clock_max_mhz=1980, slowdowns=[], pcie_gen=5,
               pcie_width=16, pcie_gen_max=5, pcie_gen_gpu_max=5, pcie_width_max=16, nvlinks_active=None)
    pairs = [{"a": a, "b": b, "p2p": "chipset not supported" if p2p_off else "OK", "link": "PHB"}
             for a in range(gpus) for b in range(a + 1, gpus)]
    return gpu.HostFacts("580.95.05", "13.0", [gpu.GpuFacts(index=i, pci_bus_id=f"0000:1{i}:00.0", **one)
                                               for i in range(gpus)], pairs)


def run_on(node, tmp_path, host):
    """The doctor on a fixture tree of a well-set host (nvidia_uvm with HMM off) and these NVML facts."""
    uvm = tmp_path / "sys/module/nvidia_uvm/parameters/uvm_disable_hmm"
    uvm.parent.mkdir(parents=True, exist_ok=True)
    uvm.write_text("Y\n")
    with mock.patch.object(gpu, "host_facts", autospec=True, return_value=host):
        return doctor_service.node_doctor_run(node.pk, str(tmp_path), root=str(tmp_path))


def test_the_report_is_stored_on_the_node_with_the_topology_and_its_nccl_presets(tmp_path):
    node = NodeFactory()
    Recipe.objects.create(kind="model", name="moonshotai/Kimi-K2.5", source="panel", path="x.yaml", digest="0",
                          data={"variants": {"default": {"vram_minimum_gb": 714}}})
    report = run_on(node, tmp_path, facts())
    node.refresh_from_db()
    assert node.host_checks == report and report["topology"] == "PCIe"
    names = [c["name"] for c in report["checks"]]
    assert names == ["engine", "driver", "topology", "p2p", "pcie", "bar", "persistence", "ecc", "clocks", "iommu",
                     "acs", "uvm_hmm", "disk", "engine_door", "exposure"]
    assert [p["name"] for p in report["nccl_presets"]] == ["PCIe, low concurrency", "PCIe, high concurrency"]
    disk = next(c for c in report["checks"] if c["name"] == "disk")
    assert "moonshotai/Kimi-K2.5" in disk["summary"] and disk["data"]["largest"] == 714 * GB


def test_a_host_without_nvml_and_a_crashing_check_never_raise(tmp_path):
    node = NodeFactory()
    with mock.patch.object(gpu, "host_facts", autospec=True, side_effect=gpu.NvmlUnavailable("Driver Not Loaded")):
        report = doctor_service.node_doctor_run(node.pk, str(tmp_path), root=str(tmp_path))
    driver = next(c for c in report["checks"] if c["name"] == "driver")
    assert driver["status"] == "unknown" and report["nccl_presets"] == []
    with mock.patch.object(doctor, "run", autospec=True, side_effect=RuntimeError("boom")):
        report = run_on(node, tmp_path, facts())
    assert report["error"] == "boom" and Node.objects.get(pk=node.pk).host_checks["error"] == "boom"


def test_a_tp_layout_on_a_host_with_p2p_off_is_warned_unless_nccl_avoids_p2p(tmp_path):
    node = NodeFactory()
    run_on(node, tmp_path, facts(p2p_off=True))
    node.refresh_from_db()
    warned = doctor_service.layout_warnings(node, {"tensor-parallel-size": 2}, {})
    assert len(warned) == 1 and "its all-reduce uses P2P between the GPUs" in warned[0]
    assert "NCCL_P2P_DISABLE=1" in warned[0]
    assert doctor_service.layout_warnings(node, {"tensor-parallel-size": 2}, {"NCCL_P2P_DISABLE": "1"}) == []
    assert doctor_service.layout_warnings(node, {"tensor-parallel-size": 1}, {}) == []  # one GPU: no P2P
    # Only the P2P-free preset is offered there.
    assert [p["env"] for p in node.host_checks["nccl_presets"]] == [{"NCCL_P2P_DISABLE": "1", "NCCL_MIN_NCHANNELS": "16"}]


def test_the_node_page_lists_every_check_with_its_fix(operator_client, tmp_path):
    node = NodeFactory()
    run_on(node, tmp_path, facts(p2p_off=True))
    html = operator_client.get(reverse("node-detail", args=[node.pk])).content.decode()
    assert 'id="doctor"' in html and 'data-check="p2p" data-status="fail"' in html
    assert "P2P off between 1 of 1 GPU pairs: 0-1 (chipset not supported)" in html
    assert "NCCL_P2P_DISABLE=1" in html and 'id="nccl-presets"' in html
    fresh = NodeFactory()
    assert "Not checked yet" in operator_client.get(reverse("node-detail", args=[fresh.pk])).content.decode()


def test_the_deploy_warning_names_the_failing_check_for_the_forms_layout(tmp_path, rf):
    node = NodeFactory(name="gpu-02")
    for i in range(2):
        GpuFactory(node=node, index=i)
    run_on(node, tmp_path, facts(p2p_off=True))
    node.refresh_from_db()
    model = ModelRepoFactory()
    ModelCopyFactory(model=model, node=node)
    from deployments import forms

    form = forms.DeployForm(node=node, initial={"tp": 2, "gpus": ["0", "1"], "port": 8000, "served_model_name": "m"})
    shown = hostchecks.deploy_context_fit({"model": model, "node": node, "form": form})
    assert shown["host_warnings"] and "P2P" in shown["host_warnings"][0]
    assert [p["name"] for p in shown["presets"]] == ["PCIe, high concurrency"]  # P2P off: the P2P-free one only


def test_the_engine_is_a_host_check_found_with_its_version_and_build_or_missing_with_the_fix(tmp_path, settings):
    """./panel start on a fresh machine has no engine: the node page said "It runs the CPU engine." and the first
    deploy failed with "[Errno 2] No such file or directory: 'vllm'", no fix named."""
    node = NodeFactory(engine_version="", engine_error="no engine at vllm: [Errno 2] No such file or directory: 'vllm'")
    settings.VLLM_BIN = "vllm"
    engine = next(c for c in run_on(node, tmp_path, facts())["checks"] if c["name"] == "engine")
    assert engine["status"] == "fail" and engine["summary"].startswith("no engine to run at vllm: no engine at vllm")
    assert engine["fix"].startswith("install an engine on this node: scripts/install-engine (the CPU build of vLLM")
    assert "VLLM_BIN" in engine["fix"]
    fake = tmp_path / "venv" / "bin" / "vllm"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    settings.VLLM_BIN = str(fake)
    Node.objects.filter(pk=node.pk).update(engine_version="0.32.0+cpu", engine_error="")
    engine = next(c for c in run_on(node, tmp_path, facts())["checks"] if c["name"] == "engine")
    assert (engine["status"], engine["summary"]) == ("pass", f"vLLM 0.32.0+cpu at {fake} (the CPU build)")
