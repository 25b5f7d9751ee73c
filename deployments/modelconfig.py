"""Understand a model's config.json (and its weight files) as vLLM would (no Django). Whether it
fits on a host's GPUs: modelfit.py."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

Files = list[tuple[str, int]]


@dataclass
class ModelSpec:
    """What vLLM builds from a config.json, reduced to what sizing needs."""

    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention: str  # "mla", "mqa", "gqa" or "mha"
    vocab_size: int
    context_length: int
    dtype: str | None
    tie_word_embeddings: bool
    num_parameters: int
    active_parameters: int
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    num_experts: int = 0
    num_shared_experts: int = 0
    experts_per_token: int = 0
    quant_method: str | None = None
    quant_bits: int | None = None
    quant_group_size: int | None = None
    quant_details: dict = field(default_factory=dict)
    kv_layers: int = 0  # layers keeping per-token KV; hybrid models have fewer than num_layers
    indexer_head_dim: int | None = None  # DeepSeek sparse attention (V3.2, GLM-5) indexer keys
    approximate: str | None = None  # why KV sizing is approximate; None when it is modelled exactly
    multimodal: bool = False
    weight_bytes: int | None = None  # from the files given to parse_config


# Keys vLLM takes the minimum of for max_model_len (_get_and_verify_max_len).
_MAX_LEN_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
    "model_max_length", "max_sequence_length", "max_seq_length", "seq_len",
)
_TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")
# Two-matrix MLPs (up, down); everything else is gated (gate, up, down).
_UNGATED_MLP = {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2"}
# Configs that omit tie_word_embeddings fall back to their class default; these tie.
_TIED_BY_DEFAULT = {"gpt2", "gemma", "gemma2", "gemma3", "gemma3_text", "opt", "bloom", "gpt_bigcode"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"}  # trainer leftovers


def parse_config(config: dict, files: Files | None = None, quant_config: dict | None = None) -> ModelSpec:
    """Read a config.json (and optionally the repo's files and hf_quant_config.json) into a ModelSpec."""
    cfg, multimodal = _language_model(config)
    model_type = config.get("model_type") or cfg.get("model_type") or ""
    text_type = cfg.get("model_type") or model_type
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first(cfg, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        raise ValueError("config.json lacks num_hidden_layers, hidden_size or num_attention_heads")
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv_heads is None:
        kv_heads = 1 if cfg.get("multi_query") else heads
    kv_lora = cfg.get("kv_lora_rank")
    if kv_lora:
        attention = "mla"
        # config head_dim is unreliable for MLA (GLM-5 stores the rope part); use the q·k width.
        head_dim = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    else:
        attention = "mqa" if kv_heads == 1 else "gqa" if kv_heads < heads else "mha"
        head_dim = cfg.get("head_dim") or hidden // heads
    num_experts = _first(cfg, "n_routed_experts", "num_local_experts", "num_experts") or 0
    method, bits, group, details = _quantization(
        cfg.get("quantization_config") or cfg.get("compression_config") or quant_config
    )
    kv_layers, approximate = _kv_layers(cfg, layers, attention)
    if cfg.get("index_topk"):
        approximate = "DeepSeek sparse attention: indexer cache modelled on vLLM's DeepSeek-V3.2 layout"
    total, active = _parameters(cfg, text_type, layers, hidden, heads, kv_heads, head_dim, num_experts)
    return ModelSpec(
        architecture=(config.get("architectures") or cfg.get("architectures") or [""])[0],
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention=attention,
        vocab_size=cfg.get("vocab_size") or 0,
        context_length=_context_length(cfg),
        dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        tie_word_embeddings=_tied(cfg, text_type),
        num_parameters=total,
        active_parameters=active,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
        num_experts=num_experts,
        num_shared_experts=_shared_experts(cfg, text_type) if num_experts else 0,
        experts_per_token=_first(cfg, "num_experts_per_tok", "moe_topk", "experts_per_token") or 0,
        quant_method=method,
        quant_bits=bits,
        quant_group_size=group,
        quant_details=details,
        kv_layers=kv_layers,
        indexer_head_dim=cfg.get("index_head_dim") if cfg.get("index_topk") else None,
        approximate=approximate,
        multimodal=multimodal,
        weight_bytes=weight_bytes(files) if files is not None else None,
    )


def _first(cfg: dict, *keys: str):
    """The value of the first key that is present and not null."""
    return next((cfg[k] for k in keys if cfg.get(k) is not None), None)


def _tied(cfg: dict, text_type: str) -> bool:
    """Whether lm_head reuses the embedding matrix."""
    tie = cfg.get("tie_word_embeddings")
    return bool(tie) if tie is not None else text_type in _TIED_BY_DEFAULT


def _language_model(config: dict) -> tuple[dict, bool]:
    """The language model's config: text_config over the wrapper's own plain keys, for multimodal repos."""
    for key in _TEXT_CONFIG_KEYS:
        sub = config.get(key)
        if isinstance(sub, dict) and ("num_hidden_layers" in sub or "hidden_size" in sub):
            # Wrappers keep dtype, tie_word_embeddings or quantization_config at the top level.
            outer = {k: v for k, v in config.items() if not k.endswith("_config") or k == "quantization_config"}
            return {**outer, **sub}, True
    return config, False


def _context_length(cfg: dict) -> int:
    """max_model_len as vLLM derives it (config.py _get_and_verify_max_len)."""
    lengths = [cfg[k] for k in _MAX_LEN_KEYS if isinstance(cfg.get(k), int)]
    length = min(lengths) if lengths else 2048  # vLLM's fallback when no key is present
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    # vLLM skips Gemma3, whose max_position_embeddings is already scaled.
    if isinstance(rope, dict) and "gemma3" not in cfg.get("model_type", ""):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        # su/longrope/llama3 already state the scaled length; mrope and default carry no factor.
        if kind not in ("su", "longrope", "llama3", "mrope", "default"):
            if kind == "yarn":
                length = rope.get("original_max_position_embeddings", length)
            length = int(length * rope.get("factor", 1.0))
    return length


def _kv_layers(cfg: dict, layers: int, attention: str) -> tuple[int, str | None]:
    """How many layers keep a per-token KV cache, and why that count is approximate if it is."""
    types = cfg.get("layer_types")
    if types:
        full = sum(1 for t in types if not re.search(r"linear|mamba|conv|recurrent", t))
        sliding = any("sliding" in t for t in types)
    elif cfg.get("full_attention_interval"):  # Qwen3-Next: every k-th layer is full attention
        full, sliding = layers // cfg["full_attention_interval"], False
    elif cfg.get("attn_type_list"):  # MiniMax: 1 = softmax attention, 0 = lightning (linear)
        full, sliding = sum(1 for t in cfg["attn_type_list"][:layers] if t == 1), False
    elif cfg.get("hybrid_override_pattern"):  # Nemotron-H: "*" marks attention layers
        full, sliding = cfg["hybrid_override_pattern"].count("*"), False
    else:
        full = layers
        sliding = bool(cfg.get("sliding_window")) and cfg.get("use_sliding_window") is not False
    reasons = []
    if full < layers:
        reasons.append(f"{layers - full} linear-attention layers keep per-sequence state, not counted")
    if sliding and attention != "mla":
        reasons.append("sliding-window layers counted as full attention (overestimates KV use)")
    return full, "; ".join(reasons) or None


def _shared_experts(cfg: dict, text_type: str) -> int:
    """Experts every token passes through, besides the routed ones."""
    if cfg.get("n_shared_experts") is not None:
        return cfg["n_shared_experts"]
    if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE style: one shared expert of that size
        return 1
    return 1 if text_type == "llama4_text" else 0


def _moe_layers(cfg: dict, layers: int) -> list[bool]:
    """Which decoder layers hold routed experts rather than a dense MLP."""
    if cfg.get("mlp_layer_types"):  # GLM-5: "dense" / "sparse"
        return [t == "sparse" for t in cfg["mlp_layer_types"]]
    if cfg.get("moe_layers") is not None:  # Llama 4
        return [i in set(cfg["moe_layers"]) for i in range(layers)]
    first_dense = cfg.get("first_k_dense_replace") or 0  # DeepSeek, Kimi, GLM
    freq = cfg.get("moe_layer_freq") or 1
    step = cfg.get("decoder_sparse_step") or cfg.get("interleave_moe_layer_step") or 1  # Qwen, Llama 4
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i >= first_dense and i % freq == 0 and (i + 1) % step == 0 and i not in dense for i in range(layers)]


def _attention_parameters(cfg: dict, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Weights of one attention block (projections and MLA's internal norms)."""
    if not cfg.get("kv_lora_rank"):
        bias = (heads + 2 * kv_heads) * head_dim + hidden if cfg.get("attention_bias") else 0
        return hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + bias
    rank, q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    v_dim = cfg.get("v_head_dim") or nope
    q = hidden * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    kv = hidden * (rank + rope) + rank + rank * heads * (nope + v_dim)
    total = q + kv + heads * v_dim * hidden
    if cfg.get("index_topk"):  # DSA indexer: wq_b, wk, k_norm, weights_proj
        n, d = cfg.get("index_n_heads") or 64, cfg.get("index_head_dim") or 128
        total += (q_rank or hidden) * n * d + hidden * d + 2 * d + hidden * n
    return total


def _parameters(cfg, text_type, layers, hidden, heads, kv_heads, head_dim, num_experts) -> tuple[int, int]:
    """Total and per-token active parameters of the language model, from its shapes."""
    # Multi-token-prediction layers (num_nextn_predict_layers) are left out: vLLM loads them only
    # for speculative decoding, and the published sizes (671B for DeepSeek-V3) exclude them.
    # Vision towers are left out too; the safetensors sizes in weight_bytes include them.
    matrices = 2 if text_type in _UNGATED_MLP else 3
    dense_width = _first(cfg, "intermediate_size_mlp", "intermediate_size", "ffn_hidden_size", "n_inner")
    dense_mlp = matrices * hidden * (dense_width or 4 * hidden)
    expert = matrices * hidden * (_first(cfg, "moe_intermediate_size", "intermediate_size") or 0)
    if cfg.get("shared_expert_intermediate_size"):
        shared = matrices * hidden * cfg["shared_expert_intermediate_size"] + hidden  # plus its gate
    else:
        shared = _shared_experts(cfg, text_type) * expert
    vocab = cfg.get("vocab_size") or 0
    base = vocab * hidden * (1 if _tied(cfg, text_type) else 2) + hidden  # embeddings, lm_head, final norm
    total = active = base
    # Linear-attention layers are counted with softmax-attention shapes: an approximation.
    block = _attention_parameters(cfg, hidden, heads, kv_heads, head_dim) + 2 * hidden
    top_k = _first(cfg, "num_experts_per_tok", "moe_topk", "experts_per_token") or 0
    for is_moe in _moe_layers(cfg, layers) if num_experts else [False] * layers:
        if is_moe:
            router = num_experts * hidden
            total += block + num_experts * expert + shared + router
            active += block + top_k * expert + shared + router
        else:
            total += block + dense_mlp
            active += block + dense_mlp
    return total, active


def _fold_modules(names) -> list[str]:
    """Unquantized module names with layer indices folded to '*', duplicates dropped, order kept."""
    folded: list[str] = []
    for name in names or []:
        short = name if name.startswith("re:") else re.sub(r"\.\d+(?=\.|$)", ".*", name)
        if short not in folded:
            folded.append(short)
    return folded


def _kv_scheme(scheme: dict | None) -> str | None:
    """A compressed-tensors kv_cache_scheme as a vLLM kv-cache dtype name."""
    if not scheme:
        return None
    return "fp8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else f"int{scheme.get('num_bits')}"


def _quantization(q: dict | None) -> tuple[str | None, int | None, int | None, dict]:
    """quant_method, weight bits, group size and details from a quantization_config or hf_quant_config.json."""
    if not q:
        return None, None, None, {}
    if "quantization" in q and "quant_method" not in q:  # hf_quant_config.json from ModelOpt
        q = {**q["quantization"], "quant_method": "modelopt", "producer": q.get("producer")}
    method = (q.get("quant_method") or "").lower() or None
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [g.get("weights") or {} for g in groups]
    first = weights[0] if weights else {}
    if method == "compressed-tensors":
        bits = min((w["num_bits"] for w in weights if w.get("num_bits")), default=None)
        acts = (groups[0].get("input_activations") or {}) if groups else {}
        details = {
            "format": q.get("format"), "strategy": first.get("strategy"), "type": first.get("type"),
            "symmetric": first.get("symmetric"), "activation_bits": acts.get("num_bits"),
            "targets": sorted({t for g in groups for t in g.get("targets") or []}),
            "kv_cache": _kv_scheme(q.get("kv_cache_scheme")), "unquantized": _fold_modules(q.get("ignore")),
        }
        return method, bits, first.get("group_size"), details
    if method == "fp8":
        details = {
            "weight_block_size": q.get("weight_block_size"), "activation_scheme": q.get("activation_scheme"),
            "fmt": q.get("fmt"),
            "unquantized": _fold_modules(q.get("modules_to_not_convert") or q.get("ignored_layers")),
        }
        return method, 8, None, details
    if method and method.startswith("modelopt"):  # vLLM names NVFP4 checkpoints "modelopt_fp4"
        algo = (q.get("quant_algo") or "").upper()
        bits = 4 if re.search(r"FP4|INT4|W4", algo) else 8 if re.search(r"FP8|INT8", algo) else None
        kv = q.get("kv_cache_quant_algo")
        details = {
            "quant_algo": algo, "kv_cache": kv.lower() if kv else _kv_scheme(q.get("kv_cache_scheme")),
            "unquantized": _fold_modules(q.get("exclude_modules") or q.get("ignore")),
        }
        group = q.get("group_size") or first.get("group_size") or (16 if algo == "NVFP4" else None)
        return method, bits, group, details
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        details = {
            key: q[key] for key in ("version", "zero_point", "desc_act", "sym", "checkpoint_format") if key in q
        }
        details["unquantized"] = _fold_modules(q.get("modules_to_not_convert"))
        return method, q.get("bits") or q.get("w_bit"), q.get("group_size") or q.get("q_group_size"), details
    if method == "bitsandbytes":
        bits = 4 if q.get("load_in_4bit") else 8 if q.get("load_in_8bit") else None
        skipped = _fold_modules(q.get("llm_int8_skip_modules"))
        details = {"quant_type": q.get("bnb_4bit_quant_type"), "unquantized": skipped}
        return method, bits, None, details
    if method == "mxfp4":  # gpt-oss: MoE experts in MXFP4, blocks of 32
        return method, 4, 32, {"unquantized": _fold_modules(q.get("modules_to_not_convert"))}
    return method, q.get("bits") or first.get("num_bits"), q.get("group_size") or first.get("group_size"), {}


def weight_bytes(files: Files) -> int:
    """On-disk size of the weight files vLLM would load: the best estimate of GPU weight memory."""
    # Only the shallowest folder holding weights counts: vLLM globs the model folder itself, so
    # Llama's original/consolidated.00.pth is never loaded (paths may be relative or absolute).
    weights = [
        (PurePosixPath(p), size) for p, size in files
        if p.lower().endswith(_WEIGHT_SUFFIXES) and PurePosixPath(p).name not in _NOT_WEIGHTS
    ]
    if not weights:
        return 0
    depth = min(len(p.parts) for p, _ in weights)
    weights = [(p, s) for p, s in weights if len(p.parts) == depth]
    # vLLM prefers safetensors and falls back to .bin/.pt; repos often ship both.
    for suffixes in ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",)):
        chosen = [(p, s) for p, s in weights if p.suffix.lower() in suffixes]
        if chosen:
            break
    # Mistral repos ship consolidated.safetensors beside the HF shards; vLLM's index filter drops it.
    if any(not p.name.startswith("consolidated") for p, _ in chosen):
        chosen = [(p, s) for p, s in chosen if not p.name.startswith("consolidated")]
    return sum(s for _, s in chosen)
