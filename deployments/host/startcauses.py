"""Why an engine's start failed, read from its log, in a plain sentence with the change that fixes it.

The causes that end starts on these hosts, each matched on the words vLLM 0.32 (or torch, transformers, NCCL) print
for it; the patterns were taken from their format strings:
- the KV cache too small for max-model-len (vllm/v1/core/kv_cache_utils.py `_check_enough_kv_cache_memory`): vLLM
  says the longest length that fits, which is the fix;
- no memory left for any KV block (the same function): a higher gpu-memory-utilization;
- CUDA out of memory while profiling or capturing CUDA graphs (torch's allocator): the `--kv-cache-memory-bytes` value vLLM
  logged before it (vllm/v1/worker/gpu_worker.py, "to fit into requested memory"), or, when it logged none, a lower
  gpu-memory-utilization;
- an attention backend this GPU or configuration cannot run (vllm/platforms/cuda.py `get_attn_backend_cls`);
- a Python package missing from the engine's environment (a load format's optional package);
- a model that needs trust-remote-code (transformers' and vLLM's own message);
- NCCL failures (peer access, unhandled system or CUDA errors): the host doctor's NCCL check, and NCCL_P2P_DISABLE;
- the port taken by another process.
Django-free: the node's plan calls it with the log's last lines and the deployment's flags.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from deployments import flagpolicy

UTILIZATION_STEP = 0.05
UTILIZATION_MAX = 0.95
MEMORY = frozenset({"kv_too_small", "no_kv_memory", "cuda_oom"})


@dataclass(frozen=True)
class Cause:
    """What ended the start (`kind`), said plainly, and the flag changes that fix it when they are certain (`fix`:
    flag -> value, applied as a retry would apply them; empty when a person must decide)."""

    kind: str
    sentence: str
    fix: dict = field(default_factory=dict)

    @property
    def retryable(self) -> bool:
        """A memory cause with a certain fix: what a deployment asking for it retries once with (retry_advised)."""
        return self.kind in MEMORY and bool(self.fix)

    def describe(self) -> str:
        changes = ", ".join(f"--{flag} {value}" for flag, value in self.fix.items())
        return f"{self.sentence}" + (f" Fix: {changes}." if changes else "")


_KV_SHORT = re.compile(r"To serve at least one request with the model'?s'? max seq len \((\d+)\), \(([\d.]+) GiB KV "
                       r"cache is needed, which is larger than the available KV cache memory \(([\d.]+) GiB\)\."
                       r"(?: Based on the available memory, the estimated maximum model length is (\d+)\.)?")
_NO_KV = re.compile(r"No available memory for the cache blocks")
_OOM = re.compile(r"CUDA out of memory\. Tried to allocate ([\d.]+ [KMG]iB)\. GPU (\d+)")
_KV_HINT = re.compile(r"Replace gpu_memory_utilization config with `--kv-cache-memory=(\d+)` \(([\d.]+) GiB\) to fit "
                      r"into requested memory")
_GRAPHS = re.compile(r"Capturing CUDA graph")
_BACKEND = re.compile(r"Selected backend (\S+) is not valid for this configuration\. Reason: (.+)$"
                      r"|No valid attention backend found for (.+?) with")
_MISSING = re.compile(r"(?:ModuleNotFoundError|ImportError): No module named '([\w.]+)'")
_REMOTE = re.compile(r"(?:pass the argument|setting|set the option) `trust_remote_code=True`")  # not the config line
_NCCL = re.compile(r"NCCL error|ncclUnhandledCudaError|ncclSystemError|ncclInternalError|peer access is not "
                   r"supported between these two devices")
_PORT = re.compile(r"\[Errno 98\].*address already in use")  # not vLLM's "Retrying with a new port" for its own


def advise(lines: list[str], flags: dict | None = None) -> Cause | None:
    """The cause of a failed start from its log's last lines (oldest first), with the fix for `flags` (the
    deployment's vLLM flags, names without dashes); None when no known cause is in them."""
    flags = flags or {}
    text = "\n".join(lines)
    if m := _KV_SHORT.search(text):
        wanted, needed, have, fits = m.groups()
        sentence = (f"The KV cache does not hold one request of max-model-len {int(wanted):,} tokens: it needs {needed} "
                    f"GiB and {have} GiB is left after the weights.")
        if fits:
            return Cause("kv_too_small", sentence + f" vLLM says {int(fits):,} tokens fit.", {"max-model-len": int(fits)})
        return Cause("kv_too_small", sentence + " Lower max-model-len or raise gpu-memory-utilization.")
    if _NO_KV.search(text):
        return Cause("no_kv_memory", "The weights and activations left no memory for the KV cache." + _more(flags),
                     _raised(flags))
    if m := _OOM.search(text):
        when = "capturing CUDA graphs" if _GRAPHS.search(text[:m.start()]) else "profiling memory"
        sentence = f"GPU {m[2]} ran out of memory while {when} (it asked for {m[1]} more)."
        if hints := _KV_HINT.findall(text[:m.start()]):
            size, gib = hints[-1]
            return Cause("cuda_oom", sentence + f" vLLM measured that a {gib} GiB KV cache fits the requested memory.",
                         {"kv-cache-memory-bytes": int(size)})
        utilization = flagpolicy.gpu_memory_utilization(flags)
        lower = round(utilization - UTILIZATION_STEP, 2)
        return Cause("cuda_oom", sentence + " Leave more room: lower gpu-memory-utilization (or max-num-seqs).",
                     {"gpu-memory-utilization": lower} if lower > 0.1 else {})
    if m := _BACKEND.search(text):
        what = f"The attention backend {m[1]} cannot run here: {m[2].strip()}." if m[1] else (
            f"No attention backend runs this model on {m[3]}.")
        return Cause("attention_backend", what + " Choose another backend (VLLM_ATTENTION_BACKEND or "
                     "--attention-backend), or another kv-cache-dtype.")
    if m := _MISSING.search(text):
        return Cause("missing_package", f"The engine's Python has no {m[1].split('.')[0]} package, which this "
                     "configuration needs (a load format's or a model's optional package): install it in the engine's "
                     "environment, or choose a configuration without it.")
    if _REMOTE.search(text):
        return Cause("trust_remote_code", "The model's repository brings its own code: it starts only with "
                     "--trust-remote-code, which an admin must allow.")
    if _NCCL.search(text):
        return Cause("nccl", "NCCL failed between the GPUs (peer-to-peer access or the PCIe topology): see the host "
                     "doctor's NCCL check; NCCL_P2P_DISABLE=1 works around a broken peer path at some speed.")
    if _PORT.search(text):
        return Cause("port_taken", "Another process took the port before the engine could bind it: choose another "
                     "port or stop that process.")
    return None


def _raised(flags: dict) -> dict:
    utilization = flagpolicy.gpu_memory_utilization(flags)
    higher = round(min(UTILIZATION_MAX, utilization + UTILIZATION_STEP), 2)
    return {"gpu-memory-utilization": higher} if higher > utilization else {}


def _more(flags: dict) -> str:
    return "" if _raised(flags) else " gpu-memory-utilization is at its ceiling: lower max-model-len or use more GPUs."
