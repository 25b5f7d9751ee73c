"""config.json understanding and fit estimates, against configs written from the published repos."""
import copy
import json
from pathlib import Path

import pytest

from deployments.modelconfig import parse_config, weight_bytes
from deployments.modelfit import fit_check, human_bytes, kv_bytes_per_token

CONFIGS = Path(__file__).parent.parent / "fixtures" / "configs"
GB = 10**9
H200 = 141 * GB


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def spec(name: str, **kwargs):
    return parse_config(load(name), **kwargs)


def within(value: float, expected: float, percent: float) -> bool:
    return abs(value - expected) <= expected * percent / 100


# --- DeepSeek-V3 --------------------------------------------------------------------------------


def test_deepseek_v3_is_read_as_mla_moe_with_128x128_fp8_blocks():
    s = spec("deepseek-v3")
    assert (s.architecture, s.model_type, s.attention) == ("DeepseekV3ForCausalLM", "deepseek_v3", "mla")
    assert (s.num_layers, s.hidden_size, s.num_attention_heads) == (61, 7168, 128)
    assert (s.kv_lora_rank, s.qk_rope_head_dim, s.head_dim) == (512, 64, 192)
    assert (s.num_experts, s.num_shared_experts, s.experts_per_token) == (256, 1, 8)
    assert (s.quant_method, s.quant_bits, s.quant_group_size) == ("fp8", 8, None)
    assert s.quant_details["weight_block_size"] == [128, 128]
    assert s.quant_details["activation_scheme"] == "dynamic"
    assert (s.dtype, s.vocab_size, s.tie_word_embeddings) == ("bfloat16", 129280, False)


def test_deepseek_v3_context_is_yarn_original_length_times_factor():
    assert spec("deepseek-v3").context_length == 4096 * 40 == 163840


def test_deepseek_v3_estimate_matches_published_671b_total_and_37b_active():
    s = spec("deepseek-v3")
    assert within(s.num_parameters, 671e9, 1)
    assert within(s.active_parameters, 37e9, 3)
    assert round(s.num_parameters / 1e9) == 671


def test_deepseek_v3_mla_caches_one_latent_per_layer():
    assert kv_bytes_per_token(spec("deepseek-v3")) == 61 * (512 + 64) * 2 == 70_272


def test_mla_latent_is_replicated_on_every_tp_rank_not_sharded():
    s = spec("deepseek-v3")
    assert kv_bytes_per_token(s, tp=8) == kv_bytes_per_token(s) == 70_272
    assert kv_bytes_per_token(s, kv_cache_dtype="fp8", tp=8) == 61 * 576


# --- Kimi-K2 and Kimi-K2.5 ----------------------------------------------------------------------


def test_kimi_k2_estimate_is_about_one_trillion_with_32b_active():
    s = spec("kimi-k2-instruct")
    assert (s.num_experts, s.num_attention_heads, s.model_type) == (384, 64, "kimi_k2")
    assert within(s.num_parameters, 1.03e12, 2)
    assert within(s.active_parameters, 32e9, 4)
    assert round(s.num_parameters / 1e12, 2) == 1.03
    assert s.context_length == 131072


def test_kimi_k25_language_model_is_read_from_text_config():
    s = spec("kimi-k2.5-int4")
    assert s.architecture == "KimiK25ForConditionalGeneration"
    assert s.model_type == "kimi_k25"
    assert s.multimodal
    assert (s.attention, s.num_layers, s.hidden_size, s.num_experts) == ("mla", 61, 7168, 384)
    assert s.context_length == 4096 * 64 == 262144
    assert s.dtype == "bfloat16"
    assert within(s.num_parameters, 1.03e12, 2)


def test_kimi_k25_reports_int4_group_32_pack_quantized_experts_and_unquantized_modules():
    s = spec("kimi-k2.5-int4")
    assert (s.quant_method, s.quant_bits, s.quant_group_size) == ("compressed-tensors", 4, 32)
    d = s.quant_details
    assert (d["format"], d["strategy"], d["type"], d["symmetric"]) == ("pack-quantized", "group", "int", True)
    assert d["activation_bits"] is None and d["kv_cache"] is None
    assert "lm_head" in d["unquantized"]
    assert "re:.*self_attn.*" in d["unquantized"]


def test_quantization_config_at_the_wrappers_top_level_is_found_too():
    config = load("kimi-k2.5-int4")
    config["quantization_config"] = config["text_config"].pop("quantization_config")
    assert parse_config(config).quant_bits == 4


def test_per_layer_ignore_lists_fold_into_one_entry_per_module():
    config = load("llama-3.1-8b-instruct")
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
        }},
        "ignore": ["lm_head"] + [f"model.layers.{i}.mlp.down_proj" for i in range(32)],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
    s = parse_config(config)
    assert s.quant_details["unquantized"] == ["lm_head", "model.layers.*.mlp.down_proj"]
    assert (s.quant_bits, s.quant_details["activation_bits"], s.quant_details["kv_cache"]) == (8, 8, "fp8")


# --- Llama ----------------------------------------------------------------------------------------


def test_llama_31_8b_is_gqa_with_131072_context_because_vllm_leaves_llama3_rope_alone():
    s = spec("llama-3.1-8b-instruct")
    assert (s.attention, s.num_attention_heads, s.num_kv_heads, s.head_dim) == ("gqa", 32, 8, 128)
    assert s.context_length == 131072
    assert (s.quant_method, s.quant_bits, s.quant_details) == (None, None, {})


def test_llama_31_8b_estimate_is_8_03b():
    s = spec("llama-3.1-8b-instruct")
    assert within(s.num_parameters, 8.03e9, 0.5)
    assert s.active_parameters == s.num_parameters
    assert round(s.num_parameters / 1e9, 2) == 8.03


def test_llama_31_8b_caches_131072_bytes_per_token_in_bf16():
    assert kv_bytes_per_token(spec("llama-3.1-8b-instruct")) == 2 * 32 * 8 * 128 * 2 == 131_072


def test_fp8_kv_cache_halves_bytes_per_token_for_gqa():
    s = spec("llama-3.1-8b-instruct")
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_bytes_per_token(s, kv_cache_dtype=dtype) == 131_072 // 2


def test_gqa_kv_cache_is_sharded_across_tp_until_each_gpu_holds_one_head():
    s = spec("llama-3.1-8b-instruct")
    assert kv_bytes_per_token(s, tp=2) == 131_072 // 2
    assert kv_bytes_per_token(s, tp=8) == 131_072 // 8
    # Eight KV heads on 16 ranks: vLLM replicates, each rank still holds one head.
    assert kv_bytes_per_token(s, tp=16) == 131_072 // 8


def test_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_bytes_per_token(spec("llama-3.1-8b-instruct"), kv_cache_dtype="int3")


def test_llama_2_7b_is_plain_multi_head_attention():
    s = spec("llama-2-7b")
    assert (s.attention, s.num_kv_heads, s.context_length, s.dtype) == ("mha", 32, 4096, "float16")
    assert kv_bytes_per_token(s) == 2 * 32 * 32 * 128 * 2 == 524_288
    assert within(s.num_parameters, 6.74e9, 0.5)


def test_single_kv_head_is_called_mqa():
    config = load("llama-2-7b")
    config["num_key_value_heads"] = 1
    assert parse_config(config).attention == "mqa"


# --- Qwen -----------------------------------------------------------------------------------------


def test_qwen3_30b_a3b_estimate_is_30_5b_total_and_3_3b_active():
    s = spec("qwen3-30b-a3b")
    assert (s.attention, s.num_attention_heads, s.num_kv_heads, s.head_dim) == ("gqa", 32, 4, 128)
    assert (s.num_experts, s.num_shared_experts, s.experts_per_token) == (128, 0, 8)
    assert within(s.num_parameters, 30.5e9, 1)
    assert within(s.active_parameters, 3.3e9, 3)
    assert kv_bytes_per_token(s) == 2 * 48 * 4 * 128 * 2
    assert s.context_length == 40960


def test_yarn_rope_scaling_extends_context_as_vllm_does():
    config = load("qwen3-30b-a3b")
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert parse_config(config).context_length == 131072


def test_dynamic_rope_scaling_multiplies_max_position_embeddings():
    config = load("llama-2-7b")
    config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    assert parse_config(config).context_length == 8192


def test_awq_checkpoint_reports_4_bit_group_128():
    s = spec("qwen2.5-7b-instruct-awq")
    assert (s.quant_method, s.quant_bits, s.quant_group_size) == ("awq", 4, 128)
    assert s.quant_details["zero_point"] is True
    assert s.approximate is None  # sliding_window is set but use_sliding_window is false
    assert within(s.num_parameters, 7.61e9, 1)


def test_gptq_and_bitsandbytes_report_their_bits():
    config = load("llama-3.1-8b-instruct")
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}
    s = parse_config(config)
    assert (s.quant_method, s.quant_bits, s.quant_group_size, s.quant_details["desc_act"]) == ("gptq", 4, 128, True)
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "llm_int8_skip_modules": ["lm_head"],
    }
    s = parse_config(config)
    assert (s.quant_method, s.quant_bits, s.quant_details["quant_type"]) == ("bitsandbytes", 4, "nf4")
    assert s.quant_details["unquantized"] == ["lm_head"]


def test_hybrid_linear_attention_counts_only_full_attention_layers_and_says_so():
    config = load("qwen3-30b-a3b")
    config["full_attention_interval"] = 4
    s = parse_config(config)
    assert s.kv_layers == 12
    assert kv_bytes_per_token(s) == 2 * 12 * 4 * 128 * 2
    assert "linear-attention" in s.approximate
    assert fit_check(s, 61 * GB, [H200], tp=1).approximate


def test_sliding_window_layers_are_counted_in_full_and_flagged():
    config = load("llama-2-7b")
    config["layer_types"] = ["sliding_attention", "full_attention"] * 16
    s = parse_config(config)
    assert s.kv_layers == 32
    assert "sliding-window" in s.approximate


# --- GLM-5 NVFP4 and MiniMax-M2.5 ---------------------------------------------------------------


def test_glm5_nvfp4_reports_modelopt_4_bit_group_16_with_fp8_kv_and_excluded_modules():
    s = spec("glm-5-nvfp4")
    assert (s.quant_method, s.quant_bits, s.quant_group_size) == ("modelopt", 4, 16)
    assert s.quant_details["quant_algo"] == "NVFP4"
    assert s.quant_details["kv_cache"] == "fp8"
    assert "model.layers.*.self_attn*" in s.quant_details["unquantized"]
    assert "lm_head" in s.quant_details["unquantized"]
    assert s.dtype == "bfloat16"  # GLM-5 writes "dtype", not "torch_dtype"


def test_hf_quant_config_json_is_read_when_config_json_has_no_quantization():
    config = load("glm-5-nvfp4")
    del config["quantization_config"]
    s = parse_config(config, quant_config=load("glm-5-nvfp4.hf_quant_config"))
    assert (s.quant_method, s.quant_bits, s.quant_group_size) == ("modelopt", 4, 16)
    assert s.quant_details["kv_cache"] == "fp8"
    assert "model.layers.*.mlp.shared_experts*" in s.quant_details["unquantized"]


def test_glm5_estimate_matches_published_744b_total_and_about_40b_active():
    s = spec("glm-5-nvfp4")
    assert (s.attention, s.num_layers, s.num_experts, s.head_dim) == ("mla", 78, 256, 256)
    assert within(s.num_parameters, 744e9, 1)
    assert within(s.active_parameters, 40e9, 5)
    assert s.context_length == 202752


def test_glm5_sparse_attention_adds_the_indexer_cache_and_is_flagged_approximate():
    s = spec("glm-5-nvfp4")
    assert kv_bytes_per_token(s) == 78 * ((512 + 64) * 2 + 128 + 4)
    assert kv_bytes_per_token(s, kv_cache_dtype="fp8") == 78 * (656 + 132)
    assert "sparse attention" in s.approximate


def test_minimax_m25_is_gqa_fp8_moe_of_about_230b():
    s = spec("minimax-m2.5")
    assert (s.attention, s.num_kv_heads, s.num_experts, s.num_shared_experts) == ("gqa", 8, 256, 0)
    assert (s.quant_method, s.quant_bits, s.kv_layers, s.approximate) == ("fp8", 8, 62, None)
    assert within(s.num_parameters, 230e9, 2)
    assert kv_bytes_per_token(s) == 2 * 62 * 8 * 128 * 2


# --- Weight files --------------------------------------------------------------------------------


def test_weight_bytes_sums_only_the_files_vllm_would_load():
    files = [
        ("config.json", 5_000),
        ("model-00001-of-00002.safetensors", 5 * GB),
        ("model-00002-of-00002.safetensors", 3 * GB),
        ("model.safetensors.index.json", 30_000),
        ("pytorch_model-00001-of-00002.bin", 5 * GB),  # vLLM prefers safetensors
        ("original/consolidated.00.pth", 16 * GB),  # not in the model folder itself
        ("training_args.bin", 6_000),
    ]
    assert weight_bytes(files) == 8 * GB


def test_weight_bytes_falls_back_to_bin_and_ignores_mistral_consolidated_duplicate():
    assert weight_bytes([("pytorch_model.bin", 14 * GB), ("tokenizer.json", 2_000_000)]) == 14 * GB
    mistral = [("consolidated.safetensors", 14 * GB), ("model-00001-of-00001.safetensors", 14 * GB)]
    assert weight_bytes(mistral) == 14 * GB


def test_weight_bytes_accepts_absolute_paths():
    files = [(f"/models/kimi/model-{i:05d}-of-000064.safetensors", 547 * GB // 64) for i in range(1, 65)]
    assert weight_bytes(files) == 547 * GB // 64 * 64


def test_parse_config_records_weight_bytes_of_the_files_given():
    files = [("model.safetensors", 16 * GB), ("README.md", 9_000)]
    assert spec("llama-3.1-8b-instruct", files=files).weight_bytes == 16 * GB
    assert spec("llama-3.1-8b-instruct").weight_bytes is None


# --- Fit checks ----------------------------------------------------------------------------------

KIMI_WEIGHTS = 547 * GB  # Kimi-K2.5 INT4: 64 safetensors shards


def test_kimi_k25_int4_fits_on_eight_h200_at_tp8_with_room_for_kv_cache():
    r = fit_check(spec("kimi-k2.5-int4"), KIMI_WEIGHTS, [H200] * 8, tp=8)
    assert r.fits
    assert (r.tp, r.pp, r.gpus_needed) == (8, 1, 8)
    assert r.weight_bytes_per_gpu == KIMI_WEIGHTS // 8
    assert r.budget_per_gpu == int(H200 * 0.9)
    assert r.kv_bytes_per_token == r.kv_bytes_per_token_per_gpu == 70_272
    assert r.kv_tokens > r.context_length == 262144
    assert r.max_concurrent_at_context == r.kv_tokens // 262144 >= 1
    assert r.message.startswith("fits, ~")
    assert "tokens of KV cache at TP=8" in r.message


def test_kimi_k25_int4_does_not_fit_on_four_h200():
    r = fit_check(spec("kimi-k2.5-int4"), KIMI_WEIGHTS, [H200] * 8, tp=4)
    assert not r.fits
    assert r.kv_tokens == 0
    # 547 GB (509 GiB) of weights + 4 × 4 GiB overhead, against 4 × 141 GB × 0.90 (473 GiB).
    assert r.message.startswith("does not fit: needs 525 GiB, has 473 GiB")


def test_fp8_kv_cache_doubles_the_tokens_that_fit_for_mla():
    s = spec("kimi-k2.5-int4")
    auto = fit_check(s, KIMI_WEIGHTS, [H200] * 8, tp=8)
    fp8 = fit_check(s, KIMI_WEIGHTS, [H200] * 8, tp=8, kv_cache_dtype="fp8")
    assert fp8.kv_tokens in (2 * auto.kv_tokens, 2 * auto.kv_tokens + 1)


def test_pipeline_parallel_splits_layers_so_each_gpu_caches_fewer_per_token():
    s = spec("kimi-k2.5-int4")
    r = fit_check(s, KIMI_WEIGHTS, [H200] * 8, tp=4, pp=2)
    assert r.fits and r.gpus_needed == 8
    assert r.kv_bytes_per_token_per_gpu == 31 * 576 * 2
    assert "TP=4 × PP=2" in r.message


def test_tp_larger_than_the_gpu_count_is_refused_clearly():
    r = fit_check(spec("kimi-k2.5-int4"), KIMI_WEIGHTS, [H200] * 4, tp=8)
    assert not r.fits
    assert r.message == "does not fit: TP=8 needs 8 GPUs, the host has 4"


def test_tp_that_does_not_divide_the_heads_is_refused():
    r = fit_check(spec("llama-3.1-8b-instruct"), 16 * GB, [H200] * 4, tp=3)
    assert not r.fits
    assert "32 attention heads do not split evenly across TP=3" in r.message


def test_kv_cache_smaller_than_one_max_length_sequence_does_not_fit():
    r = fit_check(spec("llama-3.1-8b-instruct"), 16_060_000_000, [24 * GB], tp=1)
    assert not r.fits
    assert 0 < r.kv_tokens < 131072
    assert r.message == (
        f"fits weights but only {r.kv_tokens:,} tokens of KV cache, less than one max-length sequence (131,072)"
    )


def test_a_shorter_max_model_len_makes_the_same_gpu_fit():
    r = fit_check(spec("llama-3.1-8b-instruct"), 16_060_000_000, [24 * GB], tp=1, context_length=8192)
    assert r.fits and r.max_concurrent_at_context >= 1


def test_the_smallest_gpu_bounds_a_mixed_host():
    r = fit_check(spec("kimi-k2.5-int4"), KIMI_WEIGHTS, [H200] * 7 + [40 * GB], tp=8)
    assert not r.fits
    assert r.message.startswith("does not fit: needs 67.7 GiB per GPU, has 33.5 GiB on the smallest GPU")


def test_glm5_nvfp4_fits_on_eight_rtx_pro_6000_with_one_full_length_sequence():
    r = fit_check(spec("glm-5-nvfp4"), 440 * GB, [96 * GB] * 8, tp=8)
    assert r.fits and r.approximate
    assert r.max_concurrent_at_context >= 1


def test_fit_check_refuses_nonsense_arguments():
    s = spec("llama-3.1-8b-instruct")
    with pytest.raises(ValueError):
        fit_check(s, 16 * GB, [H200], tp=0)
    with pytest.raises(ValueError):
        fit_check(s, 16 * GB, [H200], tp=1, gpu_memory_utilization=1.5)


# --- Formatting ---------------------------------------------------------------------------------


GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("n, text", [
    (547 * GiB, "547 GiB"), (68.4 * GiB, "68.4 GiB"), (1_016 * GiB, "1,016 GiB"), (99.96 * GiB, "100 GiB"),
    (0.3 * GiB, "307 MiB"), (3.5 * MiB, "3.5 MiB"), (512, "512 B"),
])
def test_human_bytes_uses_binary_units_with_one_decimal_below_100_and_mib_below_a_gib(n, text):
    assert human_bytes(n) == text


def test_parse_config_refuses_a_config_without_shapes():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        parse_config({"architectures": ["Foo"], "model_type": "foo"})


def test_parse_config_does_not_mutate_its_input():
    config = load("kimi-k2.5-int4")
    before = copy.deepcopy(config)
    parse_config(config)
    assert config == before
