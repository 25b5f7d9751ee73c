"""Estimate whether a model (a parsed config.json and its weight bytes) fits a TP×PP layout of a
host's GPUs, and how much KV cache is left (no Django)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deployments import flagpolicy
from deployments.modelconfig import ModelSpec

GB = 10**9
GiB = 1024**3

# Per-GPU memory vLLM needs besides weights and KV cache: peak activations of its profiling run at
# the default max_num_batched_tokens (~1-2 GiB for large MoEs), non-torch memory such as NCCL
# buffers and cuBLAS workspaces (~0.5-1 GiB), CUDA graphs (recent releases charge them to the
# budget) and the small weights vLLM replicates rather than shards (norms, MLA's q_a/kv_a
# projections), which fit_check otherwise spreads evenly.
DEFAULT_OVERHEAD_BYTES_PER_GPU = 4 * GiB

_KV_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1,
}


@dataclass
class FitResult:
    """Whether a model fits a TP×PP layout and how much KV cache is left."""

    fits: bool
    tp: int
    pp: int
    gpus_needed: int
    weight_bytes_per_gpu: int
    budget_per_gpu: int  # smallest GPU used × gpu_memory_utilization
    kv_bytes_available: int  # summed over the GPUs used
    kv_bytes_per_token: int  # one full copy: all layers, all KV heads
    kv_bytes_per_token_per_gpu: int
    kv_tokens: int
    max_concurrent_at_context: int
    context_length: int
    approximate: bool
    message: str


def default_tp(gpu_count: int) -> int:
    """The TP a node's GPU count suggests: the largest power of two it has (1 without GPUs)."""
    return max((t for t in (1, 2, 4, 8, 16, 32, 64) if t <= gpu_count), default=1)


def kv_bytes_per_token(spec: ModelSpec, kv_cache_dtype: str = "auto", tp: int = 1, pp: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU of a TP×PP layout (tp=pp=1: the whole model)."""
    if kv_cache_dtype == "auto":
        # vLLM caches in the model dtype; float32 checkpoints are served in bf16 by default.
        elem = 2
    elif kv_cache_dtype in _KV_DTYPE_BYTES:
        elem = _KV_DTYPE_BYTES[kv_cache_dtype]
    else:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    layers = math.ceil(spec.kv_layers / pp)  # the stage with the most layers bounds the cache
    if spec.attention == "mla":
        # MLA caches one latent per layer (kv_lora_rank + rope dims), shared by all heads. vLLM
        # replicates it on every TP rank instead of sharding it, so TP does not divide it.
        latent = (spec.kv_lora_rank + spec.qk_rope_head_dim) * elem
        indexer = 0
        if spec.indexer_head_dim:
            # vLLM turns fp8 into fp8_ds_mla for sparse MLA: 512 fp8 + 4 fp32 scales + 64 bf16 rope
            # = 656 bytes; the indexer keeps fp8 keys plus one fp32 scale per 128 values.
            latent = 656 if elem == 1 else latent
            indexer = spec.indexer_head_dim + spec.indexer_head_dim // 128 * 4
        return layers * (latent + indexer)
    # vLLM gives each TP rank num_kv_heads // tp heads, and replicates heads when there are fewer than tp.
    heads = max(1, spec.num_kv_heads // tp)
    return 2 * layers * heads * spec.head_dim * elem


def fit_check(
    spec: ModelSpec,
    weight_bytes: int,
    gpu_memory_bytes: list[int],
    tp: int,
    pp: int = 1,
    gpu_memory_utilization: float = flagpolicy.GPU_MEMORY_UTILIZATION,
    kv_cache_dtype: str = "auto",
    overhead_bytes_per_gpu: int = DEFAULT_OVERHEAD_BYTES_PER_GPU,
    context_length: int | None = None,
) -> FitResult:
    """Estimate whether the weights plus one max-length sequence of KV cache fit on tp×pp GPUs."""
    if tp < 1 or pp < 1:
        raise ValueError("tp and pp must be at least 1")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError("gpu_memory_utilization must be in (0, 1]")
    n = tp * pp
    context = context_length or spec.context_length
    per_gpu_weights = math.ceil(weight_bytes / n)  # even split; see DEFAULT_OVERHEAD_BYTES_PER_GPU
    per_token = kv_bytes_per_token(spec, kv_cache_dtype, tp, pp)
    layout = f"TP={tp}" if pp == 1 else f"TP={tp} × PP={pp}"

    def result(fits: bool, message: str, budget: int = 0, free: tuple | list = (), tokens: int = 0) -> FitResult:
        return FitResult(
            fits=fits, tp=tp, pp=pp, gpus_needed=n, weight_bytes_per_gpu=per_gpu_weights, budget_per_gpu=budget,
            kv_bytes_available=sum(free), kv_bytes_per_token=kv_bytes_per_token(spec, kv_cache_dtype),
            kv_bytes_per_token_per_gpu=per_token, kv_tokens=tokens, max_concurrent_at_context=tokens // context,
            context_length=context, approximate=spec.approximate is not None, message=message,
        )

    if n > len(gpu_memory_bytes):
        return result(False, f"does not fit: {layout} needs {n} GPUs, the host has {len(gpu_memory_bytes)}")
    split = _tp_split_problem(spec, tp)
    if split:
        return result(False, f"does not fit: {split}")
    # vLLM uses the first tp×pp visible GPUs; the smallest of them bounds every rank.
    budgets = [int(m * gpu_memory_utilization) for m in gpu_memory_bytes[:n]]
    budget = min(budgets)
    free = [b - per_gpu_weights - overhead_bytes_per_gpu for b in budgets]
    if min(free) <= 0:
        needs, has = weight_bytes + overhead_bytes_per_gpu * n, sum(budgets)
        if needs > has:
            message = (
                f"does not fit: needs {human_bytes(needs)}, has {human_bytes(has)} "
                f"({n} GPUs × {gpu_memory_utilization:.2f} utilization at {layout})"
            )
        else:  # enough in total, but the smallest GPU cannot hold its share
            message = (
                f"does not fit: needs {human_bytes(per_gpu_weights + overhead_bytes_per_gpu)} per GPU, "
                f"has {human_bytes(budget)} on the smallest GPU at {layout}"
            )
        return result(False, message, budget)
    tokens = min(f // per_token for f in free)
    if tokens < context:
        message = (
            f"fits weights but only {tokens:,} tokens of KV cache, "
            f"less than one max-length sequence ({context:,})"
        )
        return result(False, message, budget, free, tokens)
    shown = round(tokens, -3) if tokens >= 10_000 else tokens
    sequences = tokens // context
    message = (
        f"fits, ~{shown:,} tokens of KV cache at {layout} "
        f"({sequences:,} concurrent sequence{'s' if sequences > 1 else ''} of {context:,} tokens)"
    )
    if spec.approximate:
        message += f"; approximate: {spec.approximate}"
    return result(True, message, budget, free, tokens)


def usable_memory(gpus, foreign: list[dict] | None, chosen=None) -> list[int]:
    """Each GPU's memory (of `gpus`, objects with .index and .memory_total; those in `chosen`, all when None), in
    index order, less what display servers hold on it (`foreign`: Node.foreign_processes, as the agent last saw
    them): a display server is never stopped, so its memory is never the engine's."""
    held: dict[int, int] = {}
    for p in foreign or []:
        if not p.get("display"):
            continue  # a stranger is stopped before the engine starts, or the deploy is refused
        per_gpu = p.get("gpu_memory") or {str(i): (p.get("memory") or 0) // len(p["gpus"]) for i in p.get("gpus") or []}
        for index, used in per_gpu.items():
            held[int(index)] = held.get(int(index), 0) + (used or 0)
    return [g.memory_total - held.get(g.index, 0) for g in sorted(gpus, key=lambda g: g.index)
            if chosen is None or g.index in chosen]


def _tp_split_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why vLLM would refuse this tensor-parallel size for the model's heads, if it would."""
    if spec.num_attention_heads % tp:
        return f"{spec.num_attention_heads} attention heads do not split evenly across TP={tp}"
    kv = spec.num_kv_heads
    if spec.attention != "mla" and (kv % tp if kv >= tp else tp % kv):
        return f"{kv} KV heads do not split evenly across TP={tp}"
    return None


def human_bytes(n: int | float) -> str:
    """Bytes in binary units, the one convention of every page and of nvidia-smi: '509 GiB', '63.7 GiB'."""
    if n < 10**5:
        return f"{int(n):,} B"
    value, unit = (n / 2**30, "GiB") if n >= 2**30 else (n / 2**20, "MiB")  # "302 MiB", never "0.3 GiB"
    return f"{value:.1f} {unit}" if round(value, 1) < 100 else f"{value:,.0f} {unit}"


# What a CPU engine holds besides weights and its KV cache: three processes (API server, EngineCore,
# Worker) measured at about 3 GiB together with a tiny model (FACTS.md), most of it torch and vLLM.
CPU_RUNTIME_BYTES = 3 * GiB
CPU_MIN_CORES = 2  # vLLM's CPU worker binds OpenMP threads to cores; one core leaves the API server none


@dataclass
class CpuFitResult:
    """Whether a model fits a CPU node's RAM (weights, VLLM_CPU_KVCACHE_SPACE, the engine's processes)."""

    fits: bool
    needed_bytes: int
    ram_total: int
    cpu_count: int
    message: str
    known: bool = True  # False until the node has reported its RAM
    kind: str = "cpu"


def cpu_fit_check(weight_bytes: int, ram_total: int, cpu_count: int, kv_cache_bytes: int,
                  runtime_bytes: int = CPU_RUNTIME_BYTES) -> CpuFitResult:
    """Estimate whether the CPU engine fits the host: weights + KV-cache space + its processes within RAM."""
    needed = weight_bytes + kv_cache_bytes + runtime_bytes
    parts = (f"weights {human_bytes(weight_bytes)} + KV cache {human_bytes(kv_cache_bytes)} "
             f"+ ~{human_bytes(runtime_bytes)} for the engine's processes")
    if not ram_total:
        return CpuFitResult(False, needed, 0, cpu_count,
                            f"unknown until the node reports its RAM; needs ~{human_bytes(needed)} ({parts})", known=False)
    if needed > ram_total:
        return CpuFitResult(False, needed, ram_total, cpu_count,
                            f"does not fit: needs ~{human_bytes(needed)} of RAM ({parts}), the host has {human_bytes(ram_total)}")
    if cpu_count and cpu_count < CPU_MIN_CORES:
        return CpuFitResult(False, needed, ram_total, cpu_count,
                            f"does not fit: the CPU engine needs {CPU_MIN_CORES} cores, the host has {cpu_count}")
    cores = f" on {cpu_count} cores" if cpu_count else ""
    return CpuFitResult(True, needed, ram_total, cpu_count,
                        f"fits in RAM: ~{human_bytes(needed)} of {human_bytes(ram_total)} ({parts}){cores}")
