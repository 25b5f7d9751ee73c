"""Recipe and strategy files in vllm-project/recipes' layout: read as upstream writes them, malformed ones refused
naming the file and the field, resolved for a node's GPUs with a reason per flag, and the panel's table of
combinations known to fail (deployments/recipes/). No database."""
import json
from pathlib import Path

import pytest

from deployments.recipes import compat, resolve, schema
from deployments.services.recipes import SHIPPED

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GOOD, BAD = FIXTURES / "recipes" / "good", FIXTURES / "recipes" / "bad"
H200, PRO6000, B200 = ("9.0", 141 * 10**9), ("12.0", 96 * 2**30), ("10.0", 180 * 10**9)


def _load(folder: Path):
    recipes, strategies = {}, {}
    for path in sorted(folder.glob("**/*.yaml")):
        kind, name, _, parsed = schema.parse(path.relative_to(folder).as_posix(), path.read_text())
        (recipes if kind == "model" else strategies)[name] = parsed
    return recipes, strategies


def _gpus(n, hw, nnodes=1):
    return resolve.Target(n, hw[0], hw[1], nnodes)


@pytest.mark.parametrize("name, path, where, says", [
    ("vram_text", "models/acme/Bad.yaml", "variants.default.vram_minimum_gb", "expected a number, got 'lots'"),
    ("no_default", "models/acme/Bad.yaml", "variants", "a `default` variant is required"),
    ("args_not_list", "models/acme/Bad.yaml", "model.base_args", "expected a list"),
    ("not_yaml", "models/acme/Bad.yaml", "line 4", "not valid YAML"),
    ("wrong_path", "models/acme/Bad.yaml", "model.model_id", "does not match the file's path models/acme/Bad.yaml"),
    ("override_unknown_strategy", "models/acme/Bad.yaml", "strategy_overrides.single_node_dep", "not in compatible_strategies"),
    ("strategy_name", "strategies/strategy_name.yaml", "name", "does not match the file name"),
    ("strategy_gpus", "strategies/strategy_gpus.yaml", "hardware_match", "empty range"),
])
def test_a_malformed_file_is_refused_naming_the_file_and_the_field(name, path, where, says):
    with pytest.raises(schema.RecipeError) as refused:
        schema.parse(path, (BAD / f"{name}.yaml").read_text())
    assert refused.value.file == path and refused.value.field == where and says in refused.value.message
    assert str(refused.value).startswith(f"{path}: {where}: ")


def test_a_file_outside_the_layout_is_not_a_recipe():
    with pytest.raises(schema.RecipeError, match="expected models/<org>/<model>.yaml or strategies/<name>.yaml"):
        schema.parse("README.yaml", "a: 1")


def test_an_upstream_recipe_reads_with_its_unknown_keys_and_comments_left_alone():
    recipes, strategies = _load(GOOD)
    r = recipes["acme/Moe-1T"]
    assert r.min_vllm_version == "0.40.0" and r.architecture == "moe" and r.verified == ("h200",)
    assert r.model_ids() == {"acme/moe-1t", "acme/moe-1t-nvfp4"}
    assert r.variants["nvfp4"].vram_minimum_gb == 600 and r.opt_in_features == ("spec_decoding",)
    assert set(strategies) == {"single_node_tp", "single_node_dep", "multi_node_tp", "pd_cluster"}


def test_upstream_order_later_layers_win_and_the_nvidia_block_is_the_fallback():
    recipes, strategies = _load(GOOD)
    r = resolve.resolve(recipes["acme/Moe-1T"], strategies, "default", "single_node_dep", _gpus(8, H200))
    assert r.hardware == "nvidia" and r.flags["max-num-seqs"] == "128"
    assert r.flags["data-parallel-size"] == 8 and r.flags["enable-expert-parallel"] is True and r.gpus == 8
    assert r.flags["chat-template-content-format"] == "string"  # `--a=b` as upstream writes it
    assert "speculative-config" not in str(r.flags)  # an opt-in feature stays off
    assert r.env == {"VLLM_USE_FLASHINFER_MOE_FP8": "1", "VLLM_ALLREDUCE_USE_FLASHINFER": "1"}
    assert r.reasons["enable-auto-tool-choice"].why == "Acme tool parser"
    assert r.reasons["data-parallel-size"].what == "runs N replicas"  # what the option does, beside why


def test_a_strategy_override_pins_tp_and_the_deploy_takes_that_many_gpus():
    recipes, strategies = _load(GOOD)
    r = resolve.resolve(recipes["acme/Moe-1T"], strategies, "default", "single_node_tp", _gpus(8, H200))
    assert r.flags["tensor-parallel-size"] == 4 and r.gpus == 4
    assert r.reasons["tensor-parallel-size"].source == "strategy override single_node_tp"


def test_a_blackwell_block_is_not_applied_to_sm120():
    recipes, strategies = _load(GOOD)
    sm100 = resolve.resolve(recipes["acme/Moe-1T"], strategies, "nvfp4", "single_node_dep", _gpus(8, B200))
    assert sm100.hardware == "blackwell" and sm100.flags["attention-backend"] == "FLASHINFER_MLA"
    sm120 = resolve.resolve(recipes["acme/Moe-1T"], strategies, "nvfp4", "single_node_dep", _gpus(8, PRO6000))
    assert sm120.hardware == "nvidia" and "attention-backend" not in sm120.flags


def test_what_the_panel_cannot_take_is_left_out_and_said():
    recipes, strategies = _load(GOOD)
    r = resolve.resolve(recipes["acme/Moe-1T"], strategies, "default", "multi_node_tp", _gpus(8, H200, nnodes=2))
    assert r.flags["tensor-parallel-size"] == 16 and "NCCL_SOCKET_IFNAME" not in r.env
    assert any("NCCL_SOCKET_IFNAME=$IFACE_NAME names a value of this host" in line for line in r.left_out)
    assert any("-cc.pass_config.fuse_allreduce_rms=False: not taken" in line for line in r.left_out)


@pytest.mark.parametrize("strategy, target, says", [
    ("pd_cluster", _gpus(8, H200, 2), "not something the panel deploys"),
    ("multi_node_tp", _gpus(8, H200), "needs several nodes"),
    ("single_node_tp", _gpus(8, H200, 2), "runs on one node"),
    ("single_node_dep", _gpus(1, H200), "needs at least 2 GPUs"),
])
def test_a_strategy_that_does_not_apply_says_why(strategy, target, says):
    recipes, strategies = _load(GOOD)
    with pytest.raises(resolve.ResolveError, match=says):
        resolve.resolve(recipes["acme/Moe-1T"], strategies, "default", strategy, target)


def _shipped():
    return _load(SHIPPED)


def test_the_shipped_kimi_recipe_on_rtx_pro_6000_is_the_community_validated_command():
    recipes, strategies = _shipped()
    r = resolve.resolve(recipes["moonshotai/Kimi-K2.5"], strategies, "default", "single_node_tp", _gpus(8, PRO6000))
    assert r.hardware == "sm120" and r.flags == {
        "trust-remote-code": True, "tool-call-parser": "kimi_k2", "enable-auto-tool-choice": True,
        "reasoning-parser": "kimi_k2", "attention-backend": "TRITON_MLA", "kv-cache-dtype": "fp8",
        "decode-context-parallel-size": "8", "enable-chunked-prefill": True, "enable-prefix-caching": True,
        "async-scheduling": True, "max-num-batched-tokens": "4096", "gpu-memory-utilization": "0.93",
        "load-format": "fastsafetensors", "tensor-parallel-size": 8}
    assert "NCCL graph file" in r.reasons["gpu-memory-utilization"].why  # each flag with its own reason
    assert "6-7" in r.reasons["decode-context-parallel-size"].why
    hopper = resolve.resolve(recipes["moonshotai/Kimi-K2.5"], strategies, "default", "single_node_tp", _gpus(8, H200))
    assert hopper.hardware == "hopper" and "attention-backend" not in hopper.flags


def test_the_shipped_minimax_recipe_never_runs_pure_tp8():
    recipes, strategies = _shipped()
    minimax = recipes["MiniMaxAI/MiniMax-M2.5"]
    tp = resolve.resolve(minimax, strategies, "default", "single_node_tp", _gpus(8, H200))
    assert tp.flags["tensor-parallel-size"] == 4 and "192 is not" in tp.reasons["tensor-parallel-size"].why
    tep = resolve.resolve(minimax, strategies, "default", "single_node_tep", _gpus(8, H200))
    assert tep.flags["tensor-parallel-size"] == 8 and tep.flags["enable-expert-parallel"] is True
    dep = resolve.resolve(minimax, strategies, "default", "single_node_dep", _gpus(8, H200))
    assert dep.flags["data-parallel-size"] == 8 and "tensor-parallel-size" not in dep.flags
    refused = compat.check_recipe(minimax, {"tensor-parallel-size": 8}, {}, "9.0")
    assert [r.code for r in refused] == ["recipe_failure"] and "192 is not divisible by the block of 128" in refused[0].reason
    assert compat.check_recipe(minimax, tep.flags, {}, "9.0") == []


def test_every_shipped_file_reads_and_each_recipe_resolves_on_its_own_hardware():
    recipes, strategies = _shipped()
    assert set(recipes) == {"moonshotai/Kimi-K2.5", "MiniMaxAI/MiniMax-M2.5", "zai-org/GLM-5", "local/tiny-model"}
    cpu = resolve.resolve(recipes["local/tiny-model"], strategies, "default", "single_node_tp", resolve.Target(0))
    assert cpu.hardware == "cpu" and cpu.env == {"VLLM_CPU_KVCACHE_SPACE": "1"} and cpu.flags["enforce-eager"] is True
    assert "tensor-parallel-size" not in cpu.flags and cpu.gpus == 0
    glm = resolve.resolve(recipes["zai-org/GLM-5"], strategies, "fp8", "single_node_tp", _gpus(8, PRO6000))
    assert glm.flags["kv-cache-dtype"] == "fp8_ds_mla"


def _shape(name):
    return compat.Shape.of_config(json.loads((FIXTURES / "configs" / f"{name}.json").read_text()))


@pytest.mark.parametrize("flags, capability, shape, code, says", [
    ({"attention-backend": "FLASHMLA"}, "12.0", "kimi-k2.5-int4", "attention_backend", "does not run on SM120"),
    ({"attention-backend": "CUTLASS_MLA"}, "9.0", "kimi-k2.5-int4", "attention_backend", "does not run on SM90"),
    ({"attention-backend": "FLASH_ATTN"}, "9.0", "kimi-k2.5-int4", "attention_backend", "not an MLA backend"),
    ({"attention-backend": "FLASH_ATTN_MLA", "kv-cache-dtype": "fp8"}, "9.0", "kimi-k2.5-int4", "kv_cache_dtype",
     "cannot store a fp8 KV cache"),
    ({"attention-backend": "FLEX_ATTENTION", "kv-cache-dtype": "fp8"}, "9.0", "llama-3.1-8b-instruct", "kv_cache_dtype",
     "cannot store a fp8 KV cache"),
    ({"attention-backend": "TRITON_MLA", "kv-cache-dtype": "fp8"}, "8.0", "kimi-k2.5-int4", "kv_cache_dtype", "only from SM89"),
    ({"tensor-parallel-size": 8}, "9.0", "minimax-m2.5", "tp_shape", "1536 / TP 8 = 192 is not divisible by the FP8 block of 128"),
    ({"tensor-parallel-size": 3}, "9.0", "llama-3.1-8b-instruct", "tp_shape", "TP 3 does not divide the model's 32 attention heads"),
    ({"tensor-parallel-size": 8, "decode-context-parallel-size": 16}, "9.0", "kimi-k2.5-int4", "tp_shape", "DCP 16"),
])
def test_the_panels_table_refuses_each_known_failing_case_with_its_reason_and_fix(flags, capability, shape, code, says):
    refused = compat.check_flags(flags, {}, _shape(shape), capability)
    assert code in [r.code for r in refused], refused
    hit = next(r for r in refused if r.code == code)
    assert says in hit.reason and hit.fix


@pytest.mark.parametrize("flags, capability, shape", [
    ({"attention-backend": "TRITON_MLA", "kv-cache-dtype": "fp8", "tensor-parallel-size": 8,
      "decode-context-parallel-size": 8}, "12.0", "kimi-k2.5-int4"),
    ({"tensor-parallel-size": 4}, "9.0", "minimax-m2.5"),
    ({"tensor-parallel-size": 8, "enable-expert-parallel": True}, "9.0", "minimax-m2.5"),
    ({"attention-backend": "FLASHMLA", "kv-cache-dtype": "fp8", "tensor-parallel-size": 8}, "9.0", "kimi-k2.5-int4"),
    ({"attention-backend": "FLASH_ATTN", "tensor-parallel-size": 8}, "9.0", "llama-3.1-8b-instruct"),
])
def test_the_combinations_that_work_pass(flags, capability, shape):
    assert compat.check_flags(flags, {}, _shape(shape), capability) == []


def test_the_engine_version_and_the_gpu_memory_against_the_recipe():
    recipes, _ = _shipped()
    kimi = recipes["moonshotai/Kimi-K2.5"]
    old = compat.check_version(kimi, "0.18.2")
    assert old[0].code == "engine_too_old" and "needs vLLM 0.19.1 or later" in old[0].reason and "runs 0.18.2" in old[0].reason
    assert compat.check_version(kimi, "0.32.0+cpu") == [] and compat.check_version(kimi, "") == []
    h100 = compat.check_vram(kimi, "default", 8 * 80 * 10**9, 8)  # the facts: 8 × H100 80 GB is too small
    assert h100[0].code == "too_little_vram" and "needs 714 GB" in h100[0].reason and "have 640 GB" in h100[0].reason
    assert compat.check_vram(kimi, "default", 8 * 96 * 2**30, 8) == []
