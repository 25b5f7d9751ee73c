"""The host doctor: the host settings that decide whether a multi-GPU engine works at all,
each judged pass, warn or fail with its fix in one line. Runs on the node (plain Python, no Django): NVML facts
come from gpu.host_facts(), everything else from /sys and /proc under `root`, so tests run it on fixture trees.

Why these (FACTS.md, "Recipes, fit and hosts"): NCCL locks up with nvidia_uvm's HMM on; a small BAR, an IOMMU
translating DMA or ACS redirecting P2P requests hang or slow the first all-reduce; without persistence mode each
start re-initialises the GPUs; a driver older than the engine's CUDA cannot start it at all.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deployments.host import disk, door, firewall, gpu, serveargv

PASS, WARN, FAIL, UNKNOWN = "pass", "warn", "fail", "unknown"
# The oldest Linux driver for each CUDA runtime (NVIDIA's CUDA toolkit release notes, table 3).
MIN_DRIVER_FOR_CUDA = {"12.1": 530, "12.4": 550, "12.6": 560, "12.8": 570, "12.9": 575, "13.0": 580}
ACS_CAP_ID = 0x000D
# ACS control bits that send peer-to-peer requests up to the root complex instead of across the switch.
ACS_REDIRECTS = {0x04: "P2P Request Redirect", 0x08: "P2P Completion Redirect", 0x10: "Upstream Forwarding"}


@dataclass
class Check:
    """One check's verdict; `fix` says in one line what to change (empty when it passes)."""

    name: str
    status: str
    summary: str
    fix: str = ""
    data: dict = field(default_factory=dict)


def run(*, root: str = "/", facts: gpu.HostFacts | None = None, nvml_error: str = "", engine_cuda: str | None = None,
        disk_path: str = "/", largest_recipe_bytes: int | None = None, largest_recipe: str = "",
        engines: dict[str, int] | None = None, engine: tuple[str, str, str] | None = None) -> list[Check]:
    """Every check, in the order the node page lists them. `facts` None: NVML is unavailable (`nvml_error`).
    `engines` ({name: API port} of the engines running here): audited for routes open without a key; None skips
    the door and the audit (fixture trees). `engine`: (the agent's VLLM_BIN, its version, why it could not be
    inspected) as the agent found them at its start; None skips the engine check."""
    checks = ([engine_check(*engine, engine_cuda)] if engine is not None else []) + [driver_check(facts, nvml_error, engine_cuda)]
    if facts is not None and facts.gpus:
        checks += [topology_check(facts), p2p_check(facts), pcie_check(facts), bar_check(facts),
                   persistence_check(facts), ecc_check(facts), clocks_check(facts)]
    multi = facts is not None and len(facts.gpus) > 1
    checks += [iommu_check(root, multi), acs_check(root, multi), uvm_check(root, facts is not None, multi),
               disk_check(disk_path, largest_recipe_bytes, largest_recipe, gpu_host=bool(facts and facts.gpus))]
    if engines is not None:
        checks += [door_check(), exposure_check(engines)]
    return checks


def as_data(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]


def engine_check(vllm_bin: str, version: str, error: str, cuda: str | None) -> Check:
    """Whether this node has an engine to run: vLLM found, its version and build (CPU or the CUDA it was built for)."""
    found = shutil.which(vllm_bin) or vllm_bin
    if error or not version:
        return Check("engine", FAIL, f"no engine to run at {vllm_bin}: {error or 'it did not say its version'}",
                     serveargv.ENGINE_FIX, {"vllm_bin": vllm_bin})
    build = f"built for CUDA {cuda}" if cuda else ("the CPU build" if "cpu" in version.lower() else "build not read")
    return Check("engine", PASS, f"vLLM {version} at {found} ({build})", "",
                 {"vllm_bin": found, "version": version, "cuda": cuda})


# --- NVML -----------------------------------------------------------------------------------------------------

def driver_check(facts, nvml_error: str, engine_cuda: str | None) -> Check:
    if facts is None:
        return Check("driver", UNKNOWN, f"no NVIDIA GPU: {nvml_error or 'NVML unavailable'}",
                     "install the NVIDIA driver if this host has GPUs; CPU engines need none")
    have = facts.cuda_driver_version
    summary = f"driver {facts.driver_version or '?'}, runs CUDA up to {have or '?'}"
    data = {"driver": facts.driver_version, "cuda_driver": have, "engine_cuda": engine_cuda}
    if not engine_cuda:
        return Check("driver", UNKNOWN, f"{summary}; the engine's CUDA build is unknown", "", data)
    if have and _version(have) < _version(engine_cuda):
        need = MIN_DRIVER_FOR_CUDA.get(engine_cuda)
        return Check("driver", FAIL, f"{summary}; the engine is built for CUDA {engine_cuda}",
                     f"install NVIDIA driver {need or 'newer'}+ (CUDA {engine_cuda}), or an engine built for CUDA {have}", data)
    return Check("driver", PASS, f"{summary}; the engine needs CUDA {engine_cuda}", "", data)


def topology_check(facts: gpu.HostFacts) -> Check:
    links = sorted({p["link"] or "unknown" for p in facts.pairs})
    kind = topology_kind(facts)
    data = {"kind": kind, "pairs": facts.pairs}
    if len(facts.gpus) == 1:
        return Check("topology", PASS, "one GPU: no GPU-to-GPU traffic", "", data)
    return Check("topology", PASS, f"{len(facts.gpus)} GPUs over {kind} ({', '.join(links)})", "", data)


def topology_kind(facts: gpu.HostFacts) -> str:
    """"NVLink" when every pair has an NVLink path, "PCIe" otherwise ("single" for one GPU)."""
    if len(facts.gpus) < 2:
        return "single"
    return "NVLink" if facts.pairs and all(p["link"] == "NVLink" for p in facts.pairs) else "PCIe"


def p2p_check(facts: gpu.HostFacts) -> Check:
    if len(facts.gpus) < 2:
        return Check("p2p", PASS, "one GPU: P2P not needed")
    off = [p for p in facts.pairs if p["p2p"] not in ("OK", None)]
    unknown = [p for p in facts.pairs if p["p2p"] is None]
    data = {"off": [[p["a"], p["b"], p["p2p"]] for p in off]}
    if off:
        shown = ", ".join(f"{p['a']}-{p['b']} ({p['p2p']})" for p in off[:4]) + (" …" if len(off) > 4 else "")
        return Check("p2p", FAIL, f"P2P off between {len(off)} of {len(facts.pairs)} GPU pairs: {shown}",
                     "enable ACS-free P2P (BIOS: ACS off, IOMMU passthrough) or run with NCCL_P2P_DISABLE=1", data)
    if unknown:
        return Check("p2p", UNKNOWN, f"NVML did not report P2P for {len(unknown)} pair(s)", "", data)
    return Check("p2p", PASS, f"P2P reads work between all {len(facts.pairs)} GPU pairs", "", data)


def pcie_check(facts: gpu.HostFacts) -> Check:
    """Width below the slot's is a real fault (lanes lost); a lower generation at idle is power saving, so only
    the negotiated maximum counts against what the GPU can do."""
    narrow = [g for g in facts.gpus if g.pcie_width and g.pcie_width_max and g.pcie_width < g.pcie_width_max]
    slow = [g for g in facts.gpus if g.pcie_gen_max and g.pcie_gen_gpu_max and g.pcie_gen_max < g.pcie_gen_gpu_max]
    links = sorted({f"Gen{g.pcie_gen_max or '?'} x{g.pcie_width_max or '?'}" for g in facts.gpus})
    data = {"gpus": [[g.index, g.pcie_gen, g.pcie_width, g.pcie_gen_max, g.pcie_width_max] for g in facts.gpus]}
    if narrow:
        g = narrow[0]
        return Check("pcie", FAIL, f"GPU {g.index} runs x{g.pcie_width} of x{g.pcie_width_max} PCIe lanes",
                     "reseat the card or move it to a full-width slot (check riser and bifurcation settings)", data)
    if slow:
        g = slow[0]
        return Check("pcie", WARN, f"GPU {g.index}'s link reaches Gen{g.pcie_gen_max}, the GPU can do Gen{g.pcie_gen_gpu_max}",
                     "set the slot to the GPU's PCIe generation in the BIOS (or use a slot wired for it)", data)
    return Check("pcie", PASS, f"PCIe {', '.join(links)} on every GPU", "", data)


def bar_check(facts: gpu.HostFacts) -> Check:
    small = [g for g in facts.gpus if g.bar1_total and g.memory_total and g.bar1_total < g.memory_total]
    if any(g.bar1_total is None for g in facts.gpus):
        return Check("bar", UNKNOWN, "NVML did not report the BAR1 size")
    if small:
        g = small[0]
        return Check("bar", WARN, f"GPU {g.index}'s BAR1 is {g.bar1_total >> 20:,} MiB, smaller than its memory",
                     "enable Above 4G Decoding and Resizable BAR in the BIOS", {"bar1": g.bar1_total})
    return Check("bar", PASS, f"BAR1 at full size ({facts.gpus[0].bar1_total >> 30:,} GiB)")


def persistence_check(facts: gpu.HostFacts) -> Check:
    off = [g.index for g in facts.gpus if g.persistence is False]
    if off:
        return Check("persistence", WARN, f"persistence mode off on GPU {', '.join(map(str, off))}",
                     "enable nvidia-persistenced (or run nvidia-smi -pm 1) so each start skips GPU re-initialisation")
    if any(g.persistence is None for g in facts.gpus):
        return Check("persistence", UNKNOWN, "NVML did not report persistence mode")
    return Check("persistence", PASS, "persistence mode on")


def ecc_check(facts: gpu.HostFacts) -> Check:
    bad = [g for g in facts.gpus if g.ecc_uncorrected]
    if bad:
        g = bad[0]
        return Check("ecc", FAIL, f"GPU {g.index} has {g.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded",
                     "drain the node and reset the GPU (nvidia-smi -r); if they return, replace it")
    pending = [g.index for g in facts.gpus if g.ecc_pending is not None and g.ecc_pending != g.ecc_enabled]
    if pending:
        return Check("ecc", WARN, f"ECC mode change pending on GPU {', '.join(map(str, pending))}", "reboot to apply it")
    if all(g.ecc_enabled is None for g in facts.gpus):
        return Check("ecc", PASS, "ECC not available on these GPUs")
    off = [g.index for g in facts.gpus if g.ecc_enabled is False]
    if off:
        return Check("ecc", WARN, f"ECC off on GPU {', '.join(map(str, off))}", "nvidia-smi -e 1, then reboot")
    return Check("ecc", PASS, "ECC on, no uncorrected errors")


def clocks_check(facts: gpu.HostFacts) -> Check:
    slowed = [g for g in facts.gpus if g.slowdowns]
    data = {"gpus": [[g.index, g.sm_clock_mhz, g.sm_clock_max_mhz] for g in facts.gpus]}
    if slowed:
        g = slowed[0]
        return Check("clocks", WARN, f"GPU {g.index} slowed down: {', '.join(g.slowdowns)} ({g.sm_clock_mhz} of "
                     f"{g.sm_clock_max_mhz} MHz)", "check cooling, power cables and the PSU; nvidia-smi -q -d PERFORMANCE", data)
    top = max((g.sm_clock_max_mhz or 0) for g in facts.gpus)
    return Check("clocks", PASS, f"no thermal or power slowdown (SM clock up to {top} MHz)" if top else
                 "no thermal or power slowdown", "", data)


# --- /sys and /proc -------------------------------------------------------------------------------------------

def iommu_check(root: str, multi_gpu: bool) -> Check:
    groups = glob.glob(os.path.join(root, "sys/kernel/iommu_groups/*"))
    cmdline = _read(root, "proc/cmdline") or ""
    passthrough = bool(re.search(r"\biommu=pt\b|\b(?:intel|amd)_iommu=off\b|\biommu=off\b", cmdline))
    data = {"groups": len(groups), "passthrough": passthrough}
    if not groups:
        return Check("iommu", PASS, "IOMMU off", "", data)
    if passthrough:
        return Check("iommu", PASS, f"IOMMU in passthrough ({len(groups)} groups, iommu=pt)", "", data)
    status = WARN if multi_gpu else PASS
    return Check("iommu", status, f"IOMMU translating DMA ({len(groups)} groups): GPU P2P goes through it",
                 "boot with iommu=pt (add it to GRUB_CMDLINE_LINUX) so P2P is not translated" if multi_gpu else "", data)


def acs_check(root: str, multi_gpu: bool) -> Check:
    """PCI bridges with ACS redirect on send P2P traffic up to the root complex (slow, or the first all-reduce
    hangs). Reads each bridge's extended config space (root can read all 4096 bytes)."""
    redirecting, readable, bridges = [], 0, 0
    for dev in sorted(glob.glob(os.path.join(root, "sys/bus/pci/devices/*"))):
        if not (_read(dev, "class") or "").startswith("0x0604"):  # PCI-to-PCI bridges only
            continue
        bridges += 1
        try:
            config = Path(dev, "config").read_bytes()
        except OSError:
            continue
        if len(config) <= 0x100:
            continue  # only the first 256 bytes: not root, extended capabilities not visible
        readable += 1
        control = acs_control(config)
        if control is not None and control & sum(ACS_REDIRECTS):
            redirecting.append((os.path.basename(dev), [n for b, n in ACS_REDIRECTS.items() if control & b]))
    data = {"bridges_read": readable, "redirecting": [d for d, _ in redirecting]}
    if redirecting:
        dev, bits = redirecting[0]
        more = f" and {len(redirecting) - 1} more" if len(redirecting) > 1 else ""
        return Check("acs", WARN if multi_gpu else PASS, f"ACS redirect on bridge {dev}{more} ({', '.join(bits)})",
                     "turn ACS off in the BIOS, or clear it at boot: setpci -s <bridge> ECAP_ACS+6.w=0000" if multi_gpu else "", data)
    if not bridges:  # a VM given the GPUs alone (the borrowed H200 is one): no switch between them here
        return Check("acs", PASS, "no PCI bridge visible on this host: ACS is not in the path here", "", data)
    if not readable:
        return Check("acs", UNKNOWN, f"the extended config space of {bridges} PCI bridge(s) could not be read "
                     "(the agent needs root for it)", "", data)
    return Check("acs", PASS, f"no ACS redirect on {readable} PCI bridge(s)", "", data)


def acs_control(config: bytes) -> int | None:
    """The ACS control register of a PCI device's config space, None without an ACS capability."""
    offset, seen = 0x100, set()
    while offset and offset + 8 <= len(config) and offset not in seen:
        seen.add(offset)
        header = int.from_bytes(config[offset:offset + 4], "little")
        if header == 0 or header == 0xFFFFFFFF:
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[offset + 6:offset + 8], "little")
        offset = (header >> 20) & 0xFFC
    return None


def uvm_check(root: str, has_gpus: bool, multi_gpu: bool = True) -> Check:
    """HMM on hangs NCCL between GPUs (FACTS.md): a failure on a multi-GPU host, a warning with one GPU."""
    value = _read(root, "sys/module/nvidia_uvm/parameters/uvm_disable_hmm")
    if value is None:
        if not has_gpus:
            return Check("uvm_hmm", PASS, "no NVIDIA GPU: nvidia_uvm not needed")
        return Check("uvm_hmm", WARN, "nvidia_uvm is not loaded (or has no uvm_disable_hmm)",
                     "modprobe nvidia_uvm uvm_disable_hmm=1 (CUDA loads it on first use without the option)")
    if value.strip() in ("Y", "1"):
        return Check("uvm_hmm", PASS, "nvidia_uvm with HMM disabled (uvm_disable_hmm=1)")
    return Check("uvm_hmm", FAIL if multi_gpu else WARN, "nvidia_uvm has HMM on: NCCL can lock up",
                 "echo 'options nvidia_uvm uvm_disable_hmm=1' > /etc/modprobe.d/nvidia-uvm.conf, then reload nvidia_uvm")


def disk_check(path: str, largest_bytes: int | None, largest: str = "", gpu_host: bool = True) -> Check:
    """Free space in the model store, against the largest model recipe: a warning on a GPU host, where such a model
    is what the store is for; on a host without GPUs (which serves no recipe's model) only said."""
    try:
        free = disk.disk_usage(path).free
    except OSError as exc:
        return Check("disk", UNKNOWN, f"cannot read the model store's disk: {exc}")
    data = {"free": free, "largest": largest_bytes, "recipe": largest}
    if not largest_bytes:
        return Check("disk", PASS, f"{free / 2**30:,.0f} GiB free in the model store", "", data)
    what = f"the largest recipe ({largest}, ~{largest_bytes / 2**30:,.0f} GiB)" if largest else \
        f"the largest recipe (~{largest_bytes / 2**30:,.0f} GiB)"
    if free < largest_bytes and not gpu_host:
        return Check("disk", PASS, f"{free / 2**30:,.0f} GiB free in the model store (less than {what}, which a host "
                     "without GPUs does not serve)", "", data)
    if free < largest_bytes:
        return Check("disk", WARN, f"{free / 2**30:,.0f} GiB free in the model store, less than {what}",
                     "free space, or point the model store (MODEL_STORE) at a bigger disk", data)
    return Check("disk", PASS, f"{free / 2**30:,.0f} GiB free in the model store, room for {what}", "", data)


# --- who can reach an engine ------------------------------------------------------------------------------

# Engine routes asked without a key by the exposure audit: the OpenAI API vLLM keys, and routes it never keys.
EXPOSURE_ROUTES = ("/v1/chat/completions", "/invocations", "/tokenize", "/collective_rpc", "/pause", "/metrics")


def door_check() -> Check:
    """Whether engine ports answer only the agent's uid here (host/door.py)."""
    shut, why = door.door_check()
    if shut:
        return Check("engine_door", PASS, why)
    return Check("engine_door", FAIL, f"engine ports answer every local user: {why}",
                 "run the agent as root with nftables and CAP_NET_ADMIN, and PANEL_FIREWALL on")


def exposure_check(engines: dict[str, int]) -> Check:
    """Each running engine's routes asked without a key, as an unprivileged uid (`nobody`), on this host: every
    route that answers is a door the gateway does not guard. `engines`: {deployment name: API port}."""
    if not engines:
        return Check("exposure", PASS, "no engine running here to audit")
    if os.geteuid() != 0:
        return Check("exposure", UNKNOWN, "not audited: the agent is not root, so it cannot ask as another uid")
    try:
        answers = door.ask_as(door.NOBODY, {port: list(EXPOSURE_ROUTES) for port in engines.values()})
    except firewall.FirewallError as exc:
        return Check("exposure", UNKNOWN, f"not audited: {exc}")
    found = {name: {route: status for route, status in answers.get(port, {}).items()
                    if isinstance(status, int) and status not in (401, 403)}
             for name, port in engines.items()}
    found = {name: routes for name, routes in found.items() if routes}
    data = {"engines": engines, "answers": {str(k): v for k, v in answers.items()}, "open": found}
    if not found:
        return Check("exposure", PASS, f"{len(engines)} engine(s) asked as uid {door.NOBODY} without a key: "
                     "no route answered", "", data)
    listed = "; ".join(f"{name}: " + ", ".join(f"{route} ({status})" for route, status in routes.items())
                       for name, routes in found.items())
    return Check("exposure", FAIL, f"any local user reaches engines without a key — {listed}",
                 "shut the loopback door (see the engine_door check), then restart these engines", data)


# --- the engine's CUDA, and NCCL presets that follow the topology ---------------------------------------------

def engine_cuda(vllm_bin: str) -> str | None:
    """The CUDA the engine's torch was built for, read from its venv's torch/version.py without importing it
    ("12.9"); None for a CPU build, a container engine or a venv not found."""
    found = shutil.which(vllm_bin) or vllm_bin
    venv = Path(os.path.realpath(found)).parent.parent if os.path.exists(found) else None
    if venv is None:
        return None
    for version_file in glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "torch" / "version.py")):
        text = Path(version_file).read_text(errors="replace")
        m = re.search(r"^cuda(?:\s*:\s*[\w\[\]. |]+)?\s*=\s*['\"]([\d.]+)['\"]", text, re.M)
        return m.group(1) if m else None
    return None


def nccl_presets(kind: str, p2p_ok: bool) -> list[dict]:
    """NCCL environments for the host's topology (FACTS.md): NVLink needs none beyond keeping P2P on NVLink; on
    PCIe one for low concurrency (P2P with the LL protocol) and one for high (P2P off, more channels). NCCL's own
    documentation files NCCL_PROTO under debugging variables: measure before keeping it."""
    if kind == "single":
        return []
    if kind == "NVLink":
        return [{"name": "NVLink", "env": {"NCCL_P2P_LEVEL": "NVL"}, "why": "P2P over NVLink; NCCL's defaults otherwise"}]
    high = {"name": "PCIe, high concurrency", "env": {"NCCL_P2P_DISABLE": "1", "NCCL_MIN_NCHANNELS": "16"},
            "why": "P2P off with more channels: measured ~10k tok/s against ~5k with P2P for MiniMax at high concurrency"}
    low = {"name": "PCIe, low concurrency", "env": {"NCCL_P2P_LEVEL": "SYS", "NCCL_PROTO": "LL"},
           "why": "P2P with the LL protocol: lowest latency for a few streams"}
    return [low, high] if p2p_ok else [high]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def _read(base: str, rel: str) -> str | None:
    try:
        return Path(base, rel).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None

