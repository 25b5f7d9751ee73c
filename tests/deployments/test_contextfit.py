"""How much context fits: the published Kimi-K2.5 figures, the layouts, and the calibration
from real engine logs."""
import json
from pathlib import Path

import pytest

from deployments import contextfit
from deployments.contextfit import EngineKv, Layout, calibrate, context_fit, context_table
from deployments.modelconfig import parse_config

FIXTURES = Path(__file__).parent.parent / "fixtures"
GB = 10**9
GiB = 1024**3
KIMI_WEIGHTS = 547 * GB  # Kimi-K2.5 INT4 (FACTS.md): ~68 GB per card at TP 8
RTX_PRO_6000 = 96 * GB  # as published: "8 × 96 GB"


def config(name: str) -> dict:
    return json.loads((FIXTURES / "configs" / f"{name}.json").read_text())


def kimi_row(kv_dtype: str, dcp: int, utilization: float):
    cfg = config("kimi-k2.5-int4")
    return context_fit(parse_config(cfg), KIMI_WEIGHTS, [RTX_PRO_6000] * 8, Layout(tp=8, dcp=dcp),
                       kv_dtype=kv_dtype, utilization=utilization, config=cfg)


# The published figures (FACTS.md): ~190K tokens with a BF16 KV cache and ~450K with FP8 at DCP 1, 1.5M and
# 3.6M at DCP 8. They imply ~13.2 GB of KV per card for BF16 and ~15.8 GB for FP8: the 2.6-2.9 GB between
# them is 0.03 × 96 GB, vLLM's default utilization (0.90) against the published FP8 command's 0.93. No
# single utilization reproduces both (BF16 within 5 % needs 12.7-14.0 GB, FP8 15.0-16.6 GB).
@pytest.mark.parametrize("kv_dtype, dcp, utilization, published", [
    ("auto", 1, 0.90, 190_000), ("fp8", 1, 0.93, 450_000),
    ("auto", 8, 0.90, 1_500_000), ("fp8", 8, 0.93, 3_600_000),
])
def test_kimi_k25_int4_on_eight_96gb_cards_reproduces_the_published_context(kv_dtype, dcp, utilization, published):
    row = kimi_row(kv_dtype, dcp, utilization)
    assert not row.problem
    assert abs(row.tokens - published) <= 0.05 * published, (row.tokens, published)


def test_mla_kv_is_replicated_by_tp_and_divided_only_by_dcp():
    spec = parse_config(config("kimi-k2.5-int4"))
    per_token = 61 * (512 + 64) * 2
    assert contextfit.kv_bytes_per_token_per_gpu(spec, "auto", Layout(tp=1)) == per_token == 70_272
    assert contextfit.kv_bytes_per_token_per_gpu(spec, "auto", Layout(tp=8)) == per_token
    assert contextfit.kv_bytes_per_token_per_gpu(spec, "fp8", Layout(tp=8)) == per_token // 2
    assert contextfit.kv_bytes_per_token_per_gpu(spec, "auto", Layout(tp=8, dcp=8)) == per_token // 8
    assert contextfit.dcp_sizes(spec, 8) == [1, 2, 4, 8]


def test_gqa_heads_split_by_tp_and_dcp_only_where_tp_replicates_them():
    spec = parse_config(config("llama-3.1-8b-instruct"))  # 8 KV heads of 128, 32 layers
    assert contextfit.kv_bytes_per_token_per_gpu(spec, "auto", Layout(tp=1)) == 2 * 32 * 8 * 128 * 2
    assert contextfit.kv_bytes_per_token_per_gpu(spec, "auto", Layout(tp=4)) == 2 * 32 * 2 * 128 * 2
    assert contextfit.dcp_sizes(spec, 8) == [1]  # TP 8 = 8 heads: nothing replicated for DCP to divide
    with pytest.raises(ValueError, match="replicated"):
        contextfit.kv_bytes_per_token_per_gpu(spec, "auto", Layout(tp=8, dcp=2))
    with pytest.raises(ValueError, match="must divide"):
        Layout(tp=4, dcp=3)


def test_weights_per_gpu_for_tp_ep_and_dp_layouts():
    cfg = config("kimi-k2.5-int4")
    spec = parse_config(cfg)
    tp8 = contextfit.weight_bytes_per_gpu(spec, KIMI_WEIGHTS, Layout(tp=8), cfg)
    replicated = contextfit.replicated_bytes(spec, cfg)
    assert replicated == 61 * 7168 * (1536 + 512 + 64) * 2  # q_a + kv_a, BF16, whole on every rank
    assert tp8 == pytest.approx(KIMI_WEIGHTS / 8 + replicated * 7 / 8, abs=2)
    # DP replicates the model; TP 4 × DP 2 holds twice TP 8's split per GPU, EP spreads the experts back out.
    dp = contextfit.weight_bytes_per_gpu(spec, KIMI_WEIGHTS, Layout(tp=4, dp=2), cfg)
    dp_ep = contextfit.weight_bytes_per_gpu(spec, KIMI_WEIGHTS, Layout(tp=4, dp=2, ep=True), cfg)
    experts = contextfit.routed_expert_bytes(spec, KIMI_WEIGHTS)
    assert 0.85 * KIMI_WEIGHTS < experts < KIMI_WEIGHTS  # INT4 routed experts are nearly all of it
    assert dp > 2 * (tp8 - replicated)
    assert dp_ep == pytest.approx((KIMI_WEIGHTS - experts) / 4 + experts / 8 + replicated * 3 / 4, abs=3)
    assert tp8 < dp_ep < dp


def test_dp_multiplies_sequences_not_the_longest_context():
    spec = parse_config(config("llama-3.1-8b-instruct"))
    one = context_fit(spec, 16 * GB, [80 * GB] * 2, Layout(tp=1), context=8192)
    two = context_fit(spec, 16 * GB, [80 * GB] * 2, Layout(tp=1, dp=2), context=8192)
    assert two.tokens == one.tokens and two.sequences == 2 * one.sequences > 0
    assert one.longest == min(one.tokens, 131072)


def test_a_layout_needing_more_gpus_or_memory_says_why():
    spec = parse_config(config("kimi-k2.5-int4"))
    assert "needs 8 GPUs, the node has 4" in context_fit(spec, KIMI_WEIGHTS, [141 * GB] * 4, Layout(tp=8)).problem
    row = context_fit(spec, KIMI_WEIGHTS, [80 * GB] * 8, Layout(tp=8))
    assert row.tokens == 0 and row.problem.startswith("no room for a KV cache")
    with pytest.raises(ValueError, match="utilization"):
        context_fit(spec, KIMI_WEIGHTS, [141 * GB] * 8, Layout(tp=8), utilization=1.5)


def test_the_table_has_a_row_per_kv_dtype_and_dcp_size():
    cfg = config("kimi-k2.5-int4")
    rows = context_table(parse_config(cfg), KIMI_WEIGHTS, [141 * GB] * 8, Layout(tp=8), config=cfg, context=131072)
    assert [(r.kv_dtype, r.layout.dcp) for r in rows] == [(d, n) for n in (1, 2, 4, 8) for d in ("auto", "fp8")]
    assert all(r.sequences == r.tokens // 131072 for r in rows)
    assert rows[-1].tokens > 7 * rows[0].tokens  # FP8 at DCP 8 against BF16 at DCP 1: ~16×


# --- The engine's own figure, and calibration --------------------------------------------------------------

def test_reads_the_kv_cache_from_a_recorded_real_cpu_engine_log():
    kv = EngineKv.from_lines((FIXTURES / "enginelogs" / "cpu-vllm-0.32-eager.txt").read_text().splitlines())
    assert (kv.device, kv.tokens, kv.kv_bytes, kv.explicit) == ("CPU", 2_097_152, GiB, True)
    assert kv.memory_total == int(15.21 * GiB)


def test_reads_a_gpu_engine_log():
    kv = EngineKv.from_lines([
        "(Worker_TP0 pid=7) INFO 12-01 10:06:12 [gpu_worker.py:760] Available KV cache memory: 8.73 GiB",
        "(Worker_TP1 pid=8) INFO 12-01 10:06:12 [gpu_worker.py:760] Available KV cache memory: 8.70 GiB",
        "(EngineCore pid=5) INFO 12-01 10:06:13 [kv_cache_utils.py:2327] GPU KV cache size: 57,216 tokens, "
        "Maximum concurrency for 4,096 tokens per request: 13.97x"])
    assert (kv.device, kv.tokens, kv.kv_bytes) == ("GPU", 57_216, int(8.73 * GiB))


def test_an_explicit_kv_size_has_nothing_to_calibrate():
    kv = EngineKv.from_lines((FIXTURES / "enginelogs" / "cpu-vllm-0.32-eager.txt").read_text().splitlines())
    spec = parse_config(config("llama-3.1-8b-instruct"))
    assert calibrate(context_fit(spec, GB, [100 * GB], Layout()), kv) is None


def test_calibration_corrects_the_reserve_so_the_next_estimate_hits():
    spec = parse_config(config("llama-3.1-8b-instruct"))
    first = context_fit(spec, 16 * GB, [80 * GB], Layout(), utilization=0.9)
    # The engine found 2 GiB less than estimated (a bigger activation peak than the default reserve).
    engine = EngineKv(device="GPU", tokens=(first.kv_bytes_per_gpu - 2 * GiB) // first.kv_bytes_per_token_per_gpu)
    cal = calibrate(first, engine)
    assert cal.error > 0 and cal.correction_bytes == pytest.approx(2 * GiB, abs=first.kv_bytes_per_token_per_gpu)
    # The correction carries to another utilization of the same node and model.
    again = context_fit(spec, 16 * GB, [80 * GB], Layout(), utilization=0.9, correction_bytes=cal.correction_bytes)
    assert abs(again.tokens - engine.tokens) <= 1
    assert contextfit.combined_correction([5, 100, 7]) == 7 and contextfit.combined_correction([]) == 0
