"""Unit tests of deployments.host.loadphases: start-up phases from real engine logs, comparison, prediction."""
from pathlib import Path

import pytest

from deployments.host import loadphases
from deployments.host.loadphases import PhaseClock, compare, predict, replay

# A real vLLM 0.32.0 CPU engine's log (--enforce-eager), recorded by an e2e deploy on 2026-12-01.
CPU_LOG = (Path(__file__).parent.parent / "fixtures" / "enginelogs" / "cpu-vllm-0.32-eager.txt").read_text()

# GPU lines as vLLM 0.32 formats them (its logger calls; FACTS.md), with a TP=8 P2P check and compile.
GPU_LOG = """\
(APIServer pid=3) INFO 12-01 10:00:00 [api_utils.py:286] non-default args: {'model_tag': '/models/big'}
(EngineCore pid=5) INFO 12-01 10:00:20 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/models/big'
(Worker_TP0 pid=7) INFO 12-01 10:00:30 [all_reduce_utils.py:378] generating GPU P2P access cache in /root/.cache/vllm/gpu_p2p_access_cache_for_0,1,2,3,4,5,6,7.json
(Worker_TP0 pid=7) INFO 12-01 10:01:30 [gpu_model_runner.py:4100] Starting to load model /models/big...
Loading safetensors checkpoint shards:   0% Completed | 0/64 [00:00<?, ?it/s]
Loading safetensors checkpoint shards:  34% Completed | 22/64 [01:10<02:20, 0.31it/s]
Loading safetensors checkpoint shards: 100% Completed | 64/64 [03:20<00:00, 0.31it/s]
(Worker_TP0 pid=7) INFO 12-01 10:04:50 [default_loader.py:501] Loading weights took 200.00 seconds
(Worker_TP0 pid=7) INFO 12-01 10:04:51 [gpu_model_runner.py:5150] Model loading took 68.5 GiB memory and 201.204113 seconds
(Worker_TP0 pid=7) INFO 12-01 10:05:01 [backends.py:1167] Dynamo bytecode transform time: 9.81 s
(Worker_TP0 pid=7) INFO 12-01 10:06:01 [monitor.py:62] torch.compile took 70.00 s in total
(Worker_TP0 pid=7) INFO 12-01 10:06:11 [monitor.py:92] Initial profiling/warmup run took 10.00 s
(Worker_TP0 pid=7) INFO 12-01 10:06:12 [gpu_worker.py:760] Available KV cache memory: 8.73 GiB
(EngineCore pid=5) INFO 12-01 10:06:13 [kv_cache_utils.py:2327] GPU KV cache size: 57,216 tokens, Maximum concurrency for 4,096 tokens per request: 13.97x
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|█████     | 34/67 [00:03<00:03, 10.1it/s]
(Worker_TP0 pid=7) INFO 12-01 10:07:13 [gpu_model_runner.py:6582] Graph capturing finished in 60 secs, took 0.55 GiB
(EngineCore pid=5) INFO 12-01 10:07:14 [core.py:402] init engine (profile, create kv cache, warmup model) took 143.21 s
(APIServer pid=3) INFO 12-01 10:07:20 [entry.py:140] Starting vLLM server on http://0.0.0.0:8000
"""


def test_a_real_cpu_engine_log_splits_into_process_weights_kv_cache_and_api():
    clock = replay(CPU_LOG.splitlines())
    phases = [p for p, _, _ in clock.segments]
    assert phases == ["process", "weights", "kv_cache", "api_up"]
    totals = clock.totals()
    # The CPU engine spends its start-up importing and spawning processes, not reading weights.
    assert totals["process"] > 10 * totals["weights"]
    assert clock.shards_done == clock.shards_total == 1
    assert clock.weights_s == pytest.approx(0.02)
    # The spans are contiguous from launch to the last line.
    for (_, _, end), (_, start, _) in zip(clock.segments, clock.segments[1:]):
        assert end == start
    assert clock.segments[-1][2] == sum(totals.values())


def test_gpu_lines_give_every_phase_with_back_dated_compile_and_graph_capture():
    clock = replay(GPU_LOG.splitlines())
    totals = clock.totals()
    assert [p for p, _, _ in clock.segments] == [
        "process", "p2p_check", "weights", "kv_cache", "compile", "kv_cache", "graph_capture", "api_up"]
    assert totals["p2p_check"] == 60
    assert totals["weights"] == 200  # back-dated to "took 200 s" within the load span
    assert totals["compile"] == 70   # "torch.compile took 70 s in total", printed at its end
    assert totals["graph_capture"] == pytest.approx(60, abs=1)  # then 1 s to "init engine took"
    assert clock.shards_done == clock.shards_total == 64


def test_a_phase_first_seen_mid_load_ends_the_previous_one():
    clock = PhaseClock()
    clock.feed("(Worker pid=1) INFO 12-01 10:00:00 [x.py:1] Starting to load model /m...", 5.0)
    clock.feed("Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01]", 6.0)
    assert clock.phase == "weights" and clock.totals() == {"process": 5.0, "weights": 1.0}
    clock.enter("smoke_test", 9.0)
    clock.finish(9.5)
    assert clock.totals()["smoke_test"] == 0.5
    clock.feed("INFO 12-01 10:00:00 [x.py:1] Starting vLLM server on http://x", 20.0)
    assert clock.phase == "smoke_test"  # a finished load does not move


def test_compare_names_phases_that_moved_and_which_way():
    lines = compare({"weights": 60.0, "compile": 200.0, "kv_cache": 10.0},
                    {"weights": 300.0, "compile": 80.0, "kv_cache": 10.5})
    assert lines == ["weights 4.0 min faster than last time", "torch.compile 2.0 min slower than last time"]


def test_prediction_without_history_is_none_and_with_it_counts_phases_not_reached():
    clock = replay(GPU_LOG.splitlines()[:3])  # in the P2P check
    assert predict(clock, 40.0, [], "none") is None
    history = [replay(GPU_LOG.splitlines()).totals()] * 2
    p = predict(clock, 40.0, history, "same key")
    full = sum(history[0].values())
    assert p.total_s == pytest.approx(full, rel=0.05)
    assert p.seconds_left == pytest.approx(full - 40.0, rel=0.05)
    assert 0 < p.percent < 100


def test_prediction_during_weights_follows_the_shards_and_scales_for_another_disk():
    clock = PhaseClock()
    clock.enter("weights", 10.0)
    clock.feed("Loading safetensors checkpoint shards:  25% Completed | 16/64 [00:10<00:30]", 30.0)
    history = [{"process": 10.0, "weights": 400.0, "kv_cache": 20.0}]
    p = predict(clock, 30.0, history, "same key")
    assert p.seconds_left == pytest.approx(60.0 + 20.0)  # 20 s per quarter of the shards, then KV
    before = PhaseClock()
    slow = predict(before, 5.0, history, "other node", weights_scale=2.0)
    fast = predict(before, 5.0, history, "other node", weights_scale=0.5)
    assert slow.seconds_left - fast.seconds_left == pytest.approx(400.0 * 1.5)


def test_labels_cover_every_phase():
    assert set(loadphases.LABELS) == set(loadphases.PHASES)
