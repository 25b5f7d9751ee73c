"""How much context a model holds on a layout of GPUs, and learning from the engine's own
figure after each load (no Django).

modelfit.py answers "does it fit"; this module answers "how long a context, and how many sequences at a
chosen context", for each KV-cache dtype and decode-context-parallel (DCP) size, from four parts:
- KV bytes per token on one GPU: MLA keeps one latent per layer that vLLM replicates on every TP rank, so
  only DCP divides it; GQA heads are split by TP (replicated when TP exceeds them, which DCP then divides);
- weight bytes per GPU for the layout: TP (and PP) split everything; DP replicates; with expert parallel
  the routed experts spread over TP × DP ranks while the rest is split by TP only; the small projections
  vLLM replicates (MLA's q_a/kv_a) are counted whole on every rank;
- the engine's reserve per GPU (activations of the profiling run, NCCL/cuBLAS, CUDA graphs);
- a calibration: after a load the engine logs its real KV cache size; the prediction error becomes a
  correction of the reserve for that node and model, which the next estimate uses.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from deployments import flagpolicy, modelfit
from deployments.modelconfig import ModelSpec

GB = 10**9
GiB = 1024**3
# The engine's own use of each GPU besides weights and KV cache: the profiling run's activations at the default
# max_num_batched_tokens (~1-2 GiB for a large MoE), non-torch memory (NCCL buffers, cuBLAS workspaces, ~0.5-1
# GiB) and CUDA graphs, which recent vLLM charges to the budget. Replicated weights are counted as weights.
GPU_RESERVE_BYTES = 3 * GiB
# The CPU worker's own resident memory besides weights (torch and vLLM imported, about a third of the ~3 GiB the
# three engine processes hold: FACTS.md); what vLLM's automatic CPU KV size subtracts from its request.
CPU_RESERVE_BYTES = 1 * GiB
DEFAULT_KV_DTYPES = ("auto", "fp8")
KV_DTYPE_NAMES = {"auto": "BF16", "bfloat16": "BF16", "float16": "FP16", "fp8": "FP8", "fp8_e4m3": "FP8",
                  "fp8_e5m2": "FP8 (e5m2)"}


@dataclass(frozen=True)
class Layout:
    """How the engine spreads over GPUs: TP × PP per replica, DP replicas, expert parallel on or off, DCP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False
    dcp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "dcp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {getattr(self, name)!r}")
        if self.tp % self.dcp:
            raise ValueError(f"the decode context parallel size ({self.dcp}) must divide the tensor parallel size ({self.tp})")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        parts = [f"TP {self.tp}"] + [f"PP {self.pp}"] * (self.pp > 1) + [f"DP {self.dp}"] * (self.dp > 1)
        parts += ["EP"] * self.ep + [f"DCP {self.dcp}"] * (self.dcp > 1)
        return " × ".join(p for p in parts if p != "EP") + (" + EP" if self.ep else "")


def kv_bytes_per_token_per_gpu(spec: ModelSpec, kv_dtype: str, layout: Layout) -> int:
    """KV-cache bytes one token takes on one GPU: vLLM's split by TP (GQA) or replication (MLA), then DCP."""
    per_rank = modelfit.kv_bytes_per_token(spec, kv_dtype, layout.tp, layout.pp)
    if layout.dcp > 1:
        replicas = layout.tp if spec.attention == "mla" else max(1, layout.tp // max(1, spec.num_kv_heads))
        if replicas % layout.dcp:
            raise ValueError(f"decode context parallel {layout.dcp} needs the KV cache replicated on {layout.dcp} TP "
                             f"ranks; {spec.num_kv_heads} KV heads at TP {layout.tp} give {replicas}")
        per_rank = math.ceil(per_rank / layout.dcp)
    return per_rank


def replicated_bytes(spec: ModelSpec, config: dict | None = None) -> int:
    """Weights vLLM keeps whole on every TP rank: MLA's q_a and kv_a projections (ReplicatedLinear), in the
    model dtype (quantization configs leave attention unquantized for these models)."""
    if spec.attention != "mla":
        return 0
    q_lora = _text_config(config or {}).get("q_lora_rank") or 0
    return spec.num_layers * spec.hidden_size * (q_lora + (spec.kv_lora_rank or 0) + (spec.qk_rope_head_dim or 0)) * 2


def routed_expert_bytes(spec: ModelSpec, weight_bytes: int) -> int:
    """Bytes of the routed experts in the checkpoint: their parameters (total less active, scaled to all experts)
    at the checkpoint's quantized width when it is quantized (plus one 2-byte scale per group), else the share of
    the parameters. Approximate: the quantizer's ignore list is not read per module."""
    e, k = spec.num_experts, spec.experts_per_token
    if not e or e <= k or not spec.num_parameters:
        return 0
    routed = (spec.num_parameters - spec.active_parameters) * e // (e - k)
    if spec.quant_bits and spec.quant_bits < 16:
        per_param = spec.quant_bits / 8 + (2 / spec.quant_group_size if spec.quant_group_size else 0)
        estimate = int(routed * per_param)
        if estimate < weight_bytes:
            return estimate
    return int(weight_bytes * routed / spec.num_parameters)


def weight_bytes_per_gpu(spec: ModelSpec, weight_bytes: int, layout: Layout, config: dict | None = None) -> int:
    """Weight bytes on the fullest GPU of the layout (see the module's docstring)."""
    experts = routed_expert_bytes(spec, weight_bytes) if layout.ep else 0
    rest = weight_bytes - experts
    per_gpu = math.ceil(rest / (layout.tp * layout.pp)) + math.ceil(experts / (layout.tp * layout.dp * layout.pp))
    replicated = replicated_bytes(spec, config)
    return per_gpu + math.ceil(replicated * (1 - 1 / layout.tp) / layout.pp)


@dataclass
class ContextFit:
    """One row of the answer: a KV dtype and DCP size on a layout, and what context it holds."""

    kv_dtype: str
    layout: Layout
    memory_per_gpu: int  # the smallest GPU used
    utilization: float
    weight_bytes_per_gpu: int
    reserve_bytes: int  # the engine's reserve per GPU, corrected by calibration when there is one
    correction_bytes: int  # the calibration's part of reserve_bytes (0 without one)
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_gpu: int  # what is left for the KV cache on the fullest GPU
    tokens: int  # KV-cache tokens of one replica: the longest context it can hold
    model_max: int  # the model's own longest context (max_position_embeddings as vLLM derives it)
    context: int  # the chosen context for `sequences`
    sequences: int  # sequences of `context` tokens that fit at once, over all DP replicas
    problem: str = ""  # why this row cannot run at all ("" when it can)

    @property
    def longest(self) -> int:
        """The longest context one request can have: the cache, capped by the model."""
        return min(self.tokens, self.model_max)

    @property
    def dtype_name(self) -> str:
        return KV_DTYPE_NAMES.get(self.kv_dtype, self.kv_dtype)

    def as_dict(self) -> dict:
        return {"kv_dtype": self.kv_dtype, "dtype_name": self.dtype_name, "dcp": self.layout.dcp,
                "layout": self.layout.describe(), "tokens": self.tokens, "longest": self.longest,
                "model_max": self.model_max, "context": self.context, "sequences": self.sequences,
                "weight_bytes_per_gpu": self.weight_bytes_per_gpu, "reserve_bytes": self.reserve_bytes,
                "correction_bytes": self.correction_bytes, "kv_bytes_per_gpu": self.kv_bytes_per_gpu,
                "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu, "problem": self.problem}


def context_fit(spec: ModelSpec, weight_bytes: int, gpu_memory_bytes: list[int], layout: Layout, *,
                kv_dtype: str = flagpolicy.KV_CACHE_DTYPE, utilization: float = flagpolicy.GPU_MEMORY_UTILIZATION,
                reserve_bytes: int = GPU_RESERVE_BYTES, correction_bytes: int = 0, context: int | None = None, config: dict | None = None,
                kv_bytes_per_gpu: int | None = None) -> ContextFit:
    """The context one KV dtype and layout hold on these GPUs (the first layout.gpus of them). `kv_bytes_per_gpu`
    given (an explicit KV size, as VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes): no memory arithmetic."""
    if not 0 < utilization <= 1:
        raise ValueError(f"the memory utilization must be in (0, 1], not {utilization!r}")
    context = context or spec.context_length
    if context < 1:
        raise ValueError("the context must be at least 1 token")
    per_token = kv_bytes_per_token_per_gpu(spec, kv_dtype, layout)
    weights = weight_bytes_per_gpu(spec, weight_bytes, layout, config)
    reserve = max(0, reserve_bytes + correction_bytes)
    problem = ""
    if layout.gpus > len(gpu_memory_bytes):
        problem = f"{layout.describe()} needs {layout.gpus} GPUs, the node has {len(gpu_memory_bytes)}"
    memory = min(gpu_memory_bytes[: layout.gpus]) if gpu_memory_bytes else 0
    if kv_bytes_per_gpu is None:
        kv_bytes_per_gpu = int(memory * utilization) - weights - reserve
    if kv_bytes_per_gpu <= 0 and not problem:
        problem = (f"no room for a KV cache: {modelfit.human_bytes(weights)} of weights and "
                   f"{modelfit.human_bytes(reserve)} reserved per GPU, of {modelfit.human_bytes(memory * utilization)}")
    tokens = max(0, kv_bytes_per_gpu) // per_token if not problem else 0
    return ContextFit(kv_dtype=kv_dtype, layout=layout, memory_per_gpu=memory, utilization=utilization,
                      weight_bytes_per_gpu=weights, reserve_bytes=reserve, correction_bytes=correction_bytes,
                      kv_bytes_per_token_per_gpu=per_token, kv_bytes_per_gpu=max(0, kv_bytes_per_gpu), tokens=tokens,
                      model_max=spec.context_length, context=context,
                      sequences=(tokens // context) * layout.dp if tokens else 0, problem=problem)


def dcp_sizes(spec: ModelSpec, tp: int) -> list[int]:
    """DCP sizes vLLM can run at this TP for the model: the divisors of TP that split a replicated KV cache."""
    replicas = tp if spec.attention == "mla" else max(1, tp // max(1, spec.num_kv_heads))
    return [d for d in range(1, tp + 1) if tp % d == 0 and replicas % d == 0]


def context_table(spec: ModelSpec, weight_bytes: int, gpu_memory_bytes: list[int], layout: Layout, *,
                  kv_dtypes=DEFAULT_KV_DTYPES, dcps: list[int] | None = None, **kwargs) -> list[ContextFit]:
    """One row per KV dtype and DCP size (all DCP sizes the model allows at the layout's TP by default)."""
    rows = []
    for dcp in dcps or dcp_sizes(spec, layout.tp):
        if dcp not in dcp_sizes(spec, layout.tp):
            continue
        for kv_dtype in kv_dtypes:
            row_layout = Layout(layout.tp, layout.pp, layout.dp, layout.ep, dcp)
            rows.append(context_fit(spec, weight_bytes, gpu_memory_bytes, row_layout, kv_dtype=kv_dtype, **kwargs))
    return rows


# --- What the engine itself found, from its log ------------------------------------------------------------

# "GPU KV cache size: 57,216 tokens" / "CPU KV cache size: 2,097,152 tokens" (kv_cache_utils.py, vLLM 0.32: the
# capacity of one engine in tokens, DCP's sharding included, as max concurrency × max_model_len)
_TOKENS_RE = re.compile(r"\b([GC]PU)(?: \+ host)? KV cache size: ([\d,]+) tokens")
_AVAILABLE_RE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")  # gpu_worker.py, per worker
# cpu_worker.py: "Explicitly set (1.0/15.21) GiB for KV cache on node 0." or "Auto set (a/b) GiB for KV cache
# on node 0, with c GiB requested memory for the worker. d GiB memory was consumed by non-kv usages."
_CPU_SET_RE = re.compile(r"(Explicitly|Auto) set \(([\d.]+)/([\d.]+)\) GiB for KV cache")
_CPU_CONSUMED_RE = re.compile(r"([\d.]+) GiB memory was consumed by non-kv usages")


@dataclass
class EngineKv:
    """The KV cache the engine reported while loading (None: not seen in its log)."""

    device: str = ""  # "GPU" or "CPU"
    tokens: int | None = None
    kv_bytes: int | None = None  # per worker: GPU "Available KV cache memory", CPU the size it set
    memory_total: int | None = None  # CPU: the NUMA node's memory the worker sized against
    consumed_bytes: int | None = None  # CPU auto: what the worker held besides the KV cache
    explicit: bool = False  # CPU: VLLM_CPU_KVCACHE_SPACE set, nothing to predict
    lines: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        """Take one log line; the first of each figure counts (DP replicas and workers repeat them)."""
        if m := _TOKENS_RE.search(line):
            if self.tokens is None:
                self.device, self.tokens = m.group(1), int(m.group(2).replace(",", ""))
                self.lines.append(line.strip())
        elif m := _AVAILABLE_RE.search(line):
            if self.kv_bytes is None:
                self.kv_bytes = int(float(m.group(1)) * GiB)
                self.lines.append(line.strip())
        elif m := _CPU_SET_RE.search(line):
            if self.kv_bytes is None:
                self.explicit = m.group(1) == "Explicitly"
                self.kv_bytes, self.memory_total = int(float(m.group(2)) * GiB), int(float(m.group(3)) * GiB)
                if c := _CPU_CONSUMED_RE.search(line):
                    self.consumed_bytes = int(float(c.group(1)) * GiB)
                self.lines.append(line.strip())

    @classmethod
    def from_lines(cls, lines) -> EngineKv:
        kv = cls()
        for line in lines:
            kv.feed(line)
        return kv


@dataclass
class Calibration:
    """A load's prediction against the engine's figure: the error and the reserve correction it implies."""

    predicted_tokens: int
    observed_tokens: int
    error: float  # (predicted - observed) / observed
    correction_bytes: int  # add to the reserve per GPU: positive when the estimate was too generous


def calibrate(predicted: ContextFit, observed: EngineKv) -> Calibration | None:
    """Compare an estimate with what the engine reported; None when the log gave no token count, or when the
    KV size was set explicitly (nothing was estimated). The correction is the per-GPU bytes the estimate had
    for the KV cache minus those the engine's tokens take, on top of the correction already applied."""
    if not observed.tokens or observed.explicit or not predicted.kv_bytes_per_token_per_gpu:
        return None
    per_replica = observed.tokens
    observed_bytes = per_replica * predicted.kv_bytes_per_token_per_gpu
    correction = predicted.correction_bytes + (predicted.kv_bytes_per_gpu - observed_bytes)
    error = (predicted.tokens - observed.tokens) / observed.tokens
    return Calibration(predicted.tokens, observed.tokens, round(error, 6), int(correction))


def combined_correction(corrections: list[int]) -> int:
    """The correction the next estimate uses, from the recent loads' (newest first): their median, so one odd
    load (another process on the GPU while it profiled) does not swing the estimate."""
    if not corrections:
        return 0
    ordered = sorted(corrections)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) // 2


def _text_config(config: dict) -> dict:
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict) and "hidden_size" in config[key]:
            return config[key]
    return config
