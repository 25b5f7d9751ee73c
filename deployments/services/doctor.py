"""The host doctor's report: run on the node by its agent (deployments/host/doctor.py does the
checking), kept in Node.host_checks for the node page, and the warnings the deploy form shows when a chosen
layout depends on a check that fails."""
from __future__ import annotations

import logging

from django.conf import settings
from django.utils import timezone

from deployments import flagpolicy
from deployments.host import doctor, gpu
from deployments.models import Deployment, Node, Recipe

log = logging.getLogger(__name__)
__all__ = ["DOCTOR_EVERY_S", "door_shut", "node_doctor_run", "largest_recipe", "layout_warnings", "running_engines"]
DOCTOR_EVERY_S = 600.0  # the agent runs the checks again this often (a BIOS or module change needs a reboot anyway)
# Checks whose failure breaks GPU-to-GPU traffic: they matter to any layout over more than one GPU.
MULTI_GPU_CHECKS = ("p2p", "iommu", "acs", "uvm_hmm", "pcie")


def node_doctor_run(node_id: int, model_store: str, root: str = "/") -> dict:
    """Run every check on this host and store the report on its node; never raises (a check that cannot run
    says unknown), so the agent may call it from any thread."""
    try:
        try:
            facts, nvml_error = gpu.host_facts(), ""
        except gpu.NvmlUnavailable as exc:
            facts, nvml_error = None, exc.reason
        size, name = largest_recipe()
        vllm_bin = getattr(settings, "VLLM_BIN", "vllm")
        version, error = Node.objects.values_list("engine_version", "engine_error").get(pk=node_id)  # the agent's start
        checks = doctor.run(root=root, facts=facts, nvml_error=nvml_error, engine_cuda=doctor.engine_cuda(vllm_bin),
                            disk_path=model_store or "/", largest_recipe_bytes=size, largest_recipe=name,
                            engines=running_engines(node_id), engine=(vllm_bin, version, error))
        kind = doctor.topology_kind(facts) if facts and facts.gpus else "none"
        p2p_ok = all(c.status == doctor.PASS for c in checks if c.name == "p2p")
        report = {"at": timezone.now().isoformat(), "checks": doctor.as_data(checks), "topology": kind,
                  "nccl_presets": doctor.nccl_presets(kind, p2p_ok) if kind not in ("none",) else []}
    except Exception as exc:  # noqa: BLE001 - the doctor must never take the agent down
        log.exception("node %s: host checks failed", node_id)
        report = {"at": timezone.now().isoformat(), "checks": [], "error": str(exc)[:300]}
    Node.objects.filter(pk=node_id).update(host_checks=report)
    return report


def running_engines(node_id: int) -> dict[str, int]:
    """{name: API port} of the engines serving or asleep on this node: what the exposure audit asks."""
    up = Deployment.objects.filter(node_id=node_id, status__in=Deployment.UP).exclude(port=None)
    return dict(up.values_list("name", "port"))


def door_shut(node: Node) -> bool:
    """The node's doctor proved engine ports answer only its agent (the engine_door check passed)."""
    return any(c.get("name") == "engine_door" and c.get("status") == doctor.PASS
               for c in (node.host_checks or {}).get("checks") or [])


def largest_recipe() -> tuple[int | None, str]:
    """The largest model recipe's size, from its variants' vram_minimum_gb (an upper bound on its weights on
    disk; upstream recipes carry no disk size), and its name."""
    best, name = None, ""
    for row in Recipe.objects.filter(kind=Recipe.Kind.MODEL).only("name", "data"):
        variants = (row.data or {}).get("variants") or {}
        for variant in variants.values() if isinstance(variants, dict) else []:
            gb = variant.get("vram_minimum_gb") if isinstance(variant, dict) else None
            if isinstance(gb, (int, float)) and (best is None or gb * 10**9 > best):
                best, name = int(gb * 10**9), row.name
    return best, name


def layout_warnings(node: Node, engine_args: dict, env: dict | None = None, gpu_count: int | None = None) -> list[str]:
    """What the deploy form warns about: a check this layout depends on that fails or warns on the node (P2P
    all-reduce where P2P is off, and the like), each with the check's fix. Not a refusal: the doctor's view of
    a BIOS setting can be wrong, and the user may know better."""
    report = node.host_checks or {}
    checks = {c.get("name"): c for c in report.get("checks") or []}
    if not checks:
        return []
    env = env or {}
    try:
        per_node = (flagpolicy.count(engine_args, "tensor-parallel-size")
                    * flagpolicy.count(engine_args, "pipeline-parallel-size")
                    * flagpolicy.count(engine_args, "data-parallel-size"))
    except flagpolicy.OptionError:
        return []
    gpus = gpu_count if gpu_count is not None else per_node
    warnings = []
    driver = checks.get("driver") or {}
    if driver.get("status") == doctor.FAIL and node.has_gpu:
        warnings.append(f"The engine will not start: {driver['summary']}. Fix: {driver['fix']}.")
    if gpus > 1:
        for name in MULTI_GPU_CHECKS:
            check = checks.get(name) or {}
            if check.get("status") not in (doctor.FAIL, doctor.WARN):
                continue
            if name == "p2p" and str(env.get("NCCL_P2P_DISABLE", "")) == "1":
                continue  # all-reduce already avoids P2P
            what = "its all-reduce uses P2P between the GPUs" if name == "p2p" else "it moves data between the GPUs"
            warnings.append(f"This layout ({gpus} GPUs) depends on a failing host check — {what}: "
                            f"{check['summary']}. Fix: {check['fix']}.")
    ecc = checks.get("ecc") or {}
    if ecc.get("status") == doctor.FAIL:
        warnings.append(f"{ecc['summary']}. Fix: {ecc['fix']}.")
    return warnings
