"""Combinations known to fail before the load: each check returns the reason and the fix.

The attention table is vLLM 0.32's own (`supports_compute_capability` and `supported_kv_cache_dtypes` of each
backend in vllm/v1/attention/backends/): a backend the GPU family lacks or a KV-cache dtype it cannot store
fails at engine start, after the weights were read — minutes to an hour for a large model. The TP checks
are what vLLM's linear layers assert when they shard: heads and block-quantized weights split evenly.
Plain Python: the gate (deployments/services/compatgate.py) feeds it the model's config and the node's GPUs.
"""
import re
from dataclasses import dataclass

from deployments import flagpolicy

from deployments.recipes.resolve import hardware_keys
from deployments.recipes.schema import Recipe

ANY = None
FP8 = {"fp8", "fp8_e4m3", "fp8_e5m2"}
# backend -> (for MLA models, compute capability majors it runs on (None: any), KV-cache dtypes it stores,
# the lowest capability for an fp8 KV cache)
BACKENDS = {
    "FLASH_ATTN": (False, {8, 9, 10, 11, 12}, {"auto", "float16", "bfloat16", "fp8", "fp8_e4m3"}, None),
    "FLASHINFER": (False, {8, 9, 10, 11, 12}, {"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"}, None),
    "TRITON_ATTN": (False, ANY, {"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"}, (8, 9)),
    "FLEX_ATTENTION": (False, ANY, {"auto", "float16", "bfloat16"}, None),
    "FLASHMLA": (True, {9, 10}, {"auto", "bfloat16", "fp8", "fp8_e4m3"}, None),
    "CUTLASS_MLA": (True, {10}, {"auto", "bfloat16", "fp8", "fp8_e4m3"}, None),
    "FLASHINFER_MLA": (True, {10}, {"auto", "bfloat16", "fp8", "fp8_e4m3"}, None),
    "FLASH_ATTN_MLA": (True, {9}, {"auto", "bfloat16"}, None),
    "TRITON_MLA": (True, ANY, {"auto", "bfloat16", "fp8", "fp8_e4m3"}, (8, 9)),
}
# DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: an `index_topk` in the config) runs only on these.
SPARSE_BACKENDS = {"FLASHMLA_SPARSE": {9, 10}, "FLASHINFER_MLA_SPARSE": {10}, "FLASH_ATTN_MLA_SPARSE": {9},
                   "FLASHINFER_MLA_SPARSE_SM120": {12}}


@dataclass(frozen=True)
class Refusal:
    """Why a deploy would fail, and what to change; `code` names the check."""

    code: str
    reason: str
    fix: str

    def text(self) -> str:
        return f"{self.reason}. Fix: {self.fix}"


@dataclass(frozen=True)
class Shape:
    """What the TP and attention checks read from a model's config."""

    attention: str = ""  # "mla", "gqa", ...
    sparse: bool = False
    heads: int = 0
    kv_heads: int = 0
    expert_size: int = 0  # one expert's intermediate size
    dense_size: int = 0  # a dense MLP's intermediate size
    block_n: int = 0  # the FP8 block quantization's output block (weight_block_size[0])

    @classmethod
    def of_config(cls, config: dict, attention: str = "") -> "Shape":
        cfg = next((config[k] for k in ("text_config", "language_config", "llm_config") if isinstance(config.get(k), dict)),
                   config) or {}
        experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        moe = cfg.get("moe_intermediate_size")
        quant = cfg.get("quantization_config") or config.get("quantization_config") or {}
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        return cls(attention=attention or ("mla" if cfg.get("kv_lora_rank") else ""), sparse=bool(cfg.get("index_topk")),
                   heads=_int(cfg.get("num_attention_heads")), kv_heads=_int(cfg.get("num_key_value_heads")),
                   expert_size=_int(moe or (cfg.get("intermediate_size") if experts else 0)),
                   dense_size=_int(cfg.get("intermediate_size") if (moe or not experts) else 0),
                   block_n=_int(block[0]) if isinstance(block, list) and block else 0)


def _int(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def version_tuple(text: str) -> tuple:
    """'0.19.1' -> (0, 19, 1); '0.11.1rc2.dev5+g1' -> (0, 11, 1); '' -> ()."""
    match = re.match(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", text or "")
    return tuple(int(p or 0) for p in match.groups()) if match else ()


def check_version(recipe: Recipe, engine_version: str) -> list[Refusal]:
    need, have = version_tuple(recipe.min_vllm_version), version_tuple(engine_version)
    if need and have and have < need:
        return [Refusal("engine_too_old", f"{recipe.model_id} needs vLLM {recipe.min_vllm_version} or later (its recipe's "
                        f"min_vllm_version); the node runs {engine_version}",
                        f"upgrade the node's engine to vLLM {recipe.min_vllm_version} or later")]
    return []


def check_vram(recipe: Recipe, variant: str, gpu_bytes: int, gpus: int) -> list[Refusal]:
    """The variant's vram_minimum_gb (decimal GB, as the recipe's formula) against the chosen GPUs' memory."""
    need = recipe.variants[variant].vram_minimum_gb if variant in recipe.variants else None
    if need and gpus and gpu_bytes < need * 1e9:
        return [Refusal("too_little_vram", f"{recipe.model_id} ({variant}) needs {need:,.0f} GB of GPU memory; the "
                        f"{gpus} chosen GPU(s) have {gpu_bytes / 1e9:,.0f} GB",
                        "choose more or larger GPUs, another node, or a smaller variant")]
    return []


def check_flags(flags: dict, env: dict, shape: Shape, capability: str) -> list[Refusal]:
    """The panel's table: the attention backend and KV-cache dtype for this GPU family and model, and TP
    against the model's heads and block-quantized shapes."""
    out = []
    backend = str(flags.get("attention-backend") or env.get("VLLM_ATTENTION_BACKEND") or "").upper()
    kv = flagpolicy.kv_cache_dtype(flags)
    cap = tuple(int(p) for p in capability.split(".")[:2]) if re.match(r"^\d+\.\d+$", capability or "") else ()
    family = f"SM{cap[0]}{cap[1]}" if cap else ""
    if backend and shape.sparse and backend not in SPARSE_BACKENDS:
        out.append(Refusal("attention_backend", f"{backend} has no DeepSeek sparse attention, which this model uses",
                           f"choose one of {', '.join(SPARSE_BACKENDS)} for its GPU family, or leave the backend to the engine"))
    elif backend in SPARSE_BACKENDS and cap and cap[0] not in SPARSE_BACKENDS[backend]:
        out.append(_family(backend, family, [b for b, m in SPARSE_BACKENDS.items() if cap[0] in m]))
    elif backend in BACKENDS:
        mla, majors, kv_ok, fp8_floor = BACKENDS[backend]
        if shape.attention and mla != (shape.attention == "mla"):
            kind = "MLA" if shape.attention == "mla" else "non-MLA"
            fits = [b for b, spec in BACKENDS.items() if spec[0] == (shape.attention == "mla")]
            out.append(Refusal("attention_backend", f"{backend} is {'an MLA' if mla else 'not an MLA'} backend and this "
                               f"is a {kind} model", f"choose one of {', '.join(fits)}"))
        elif cap and majors is not ANY and cap[0] not in majors:
            same = [b for b, s in BACKENDS.items() if s[0] == mla and (s[1] is ANY or cap[0] in s[1])]
            out.append(_family(backend, family, same))
        elif kv not in kv_ok:
            out.append(Refusal("kv_cache_dtype", f"the {backend} attention backend cannot store a {kv} KV cache "
                               f"(it stores {', '.join(sorted(kv_ok))})", "choose another KV-cache dtype or backend"))
        elif kv in FP8 and fp8_floor and cap and cap < fp8_floor:
            out.append(Refusal("kv_cache_dtype", f"{backend} stores an fp8 KV cache only from SM{fp8_floor[0]}{fp8_floor[1]}; "
                               f"these GPUs are {family}", "use KV-cache dtype auto"))
    if shape.sparse and cap and cap[0] == 12 and kv != "fp8_ds_mla" and backend in ("", "FLASHINFER_MLA_SPARSE_SM120"):
        out.append(Refusal("kv_cache_dtype", "on SM120 vLLM's one sparse-MLA backend (FLASHINFER_MLA_SPARSE_SM120) "
                           f"needs the packed fp8_ds_mla KV cache; {kv} was chosen", "add --kv-cache-dtype fp8_ds_mla"))
    return out + check_tp(flags, shape)


def _family(backend: str, family: str, others: list[str]) -> Refusal:
    return Refusal("attention_backend", f"the {backend} attention backend does not run on {family} GPUs",
                   f"choose {' or '.join(others) if others else 'another backend'}, or leave the backend to the engine")


def check_tp(flags: dict, shape: Shape) -> list[Refusal]:
    tp = flags.get("tensor-parallel-size") or 1
    tp = int(tp) if str(tp).isdigit() else 1
    out = []
    dcp = flags.get("decode-context-parallel-size") or 1
    dcp = int(dcp) if str(dcp).isdigit() else 1
    if dcp > 1 and tp % dcp:
        out.append(Refusal("tp_shape", f"DCP {dcp} does not divide TP {tp} (decode context parallel splits each TP "
                           "group's KV cache)", f"use a decode context parallel size that divides {tp}"))
    if shape.heads and shape.heads % tp:
        out.append(Refusal("tp_shape", f"TP {tp} does not divide the model's {shape.heads} attention heads",
                           f"use a TP that divides {shape.heads} ({_divisors(shape.heads)})"))
    if shape.kv_heads and shape.attention != "mla" and shape.kv_heads % tp and tp % shape.kv_heads:
        out.append(Refusal("tp_shape", f"TP {tp} neither divides nor is a multiple of the model's {shape.kv_heads} KV heads",
                           f"use a TP of {_divisors(shape.kv_heads)} or a multiple of {shape.kv_heads}"))
    ep = bool(flags.get("enable-expert-parallel"))
    for size, what in ((0 if ep else shape.expert_size, "expert"), (shape.dense_size, "dense MLP")):
        if size and shape.block_n and (size % tp or (size // tp) % shape.block_n):
            out.append(Refusal("tp_shape", f"the {what} intermediate size {size} / TP {tp} = {size / tp:g} is not divisible "
                               f"by the FP8 block of {shape.block_n}",
                               "use a smaller TP" + ("" if what == "dense MLP" else
                                                     ", or TP with expert parallel (TP+EP), or DP with expert parallel")))
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def check_recipe(recipe: Recipe, flags: dict, env: dict, capability: str, variant: str = "", strategy: str = "") -> list[Refusal]:
    """The recipe's own known_failures whose every condition holds for this deploy."""
    facts = {"strategy": strategy, "variant": variant, "hardware": hardware_keys(capability),
             "tensor_parallel_size": int(flags.get("tensor-parallel-size") or 1),
             "kv_cache_dtype": flagpolicy.kv_cache_dtype(flags),
             "attention_backend": str(flags.get("attention-backend") or env.get("VLLM_ATTENTION_BACKEND") or ""),
             "expert_parallel": bool(flags.get("enable-expert-parallel"))}
    out = []
    for failure in recipe.failures:
        if all(_holds(facts[k], v) for k, v in failure.when.items()):
            out.append(Refusal("recipe_failure", f"{recipe.model_id}: {failure.reason}", failure.fix))
    return out


def _holds(fact, wanted) -> bool:
    wanted = wanted if isinstance(wanted, list) else [wanted]
    if isinstance(fact, list):
        return any(w in fact for w in wanted)
    return fact in wanted or str(fact) in [str(w) for w in wanted]
