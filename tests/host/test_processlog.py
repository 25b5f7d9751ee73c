"""Unit tests of deployments.host.processlog: load phases and errors from real engine logs, reading lines."""
import pytest

from deployments.host import processlog
from deployments.host.processlog import LoadProgress

# Recorded from vLLM 0.32.0 on the CPU serving tests/tinymodel.py (2026-11-29).
CPU_LOG = """\
(APIServer pid=13703) INFO 11-29 13:23:44 [api_utils.py:286] non-default args: {'model_tag': '/work/main/var/tiny-model'}
(EngineCore pid=14207) INFO 11-29 13:24:04 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/work/main/var/tiny-model'
(Worker pid=14403) INFO 11-29 13:24:13 [cpu_model_runner.py:68] Starting to load model /work/main/var/tiny-model...
Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 205.28it/s]
(Worker pid=14403) INFO 11-29 13:24:13 [default_loader.py:501] Loading weights took 0.01 seconds
(EngineCore pid=14207) INFO 11-29 13:24:14 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 1,024 tokens per request: 2048.00x
(EngineCore pid=14207) INFO 11-29 13:24:15 [core.py:402] init engine (profile, create kv cache, warmup model) took 1.35 s
(APIServer pid=13703) INFO 11-29 13:24:16 [entry.py:140] Starting vLLM server on http://127.0.0.1:8011
INFO:     Application startup complete.
"""

# GPU lines as vLLM 0.32 formats them (its own logger format strings; FACTS.md).
GPU_LOG = """\
(Worker pid=7) INFO [gpu_model_runner.py:4100] Starting to load model /models/big...
Loading safetensors checkpoint shards:   0% Completed | 0/64 [00:00<?, ?it/s]
Loading safetensors checkpoint shards:  34% Completed | 22/64 [00:10<00:20, 2.10it/s]
Loading safetensors checkpoint shards: 100% Completed | 64/64 [00:30<00:00, 2.10it/s]
(Worker pid=7) INFO [default_loader.py:501] Loading weights took 30.52 seconds
(Worker pid=7) INFO [gpu_model_runner.py:5150] Model loading took 121.5 GiB memory and 31.204113 seconds
(Worker pid=7) INFO [backends.py:1167] Dynamo bytecode transform time: 9.81 s
(Worker pid=7) INFO [monitor.py:20] torch.compile took 25.33 s in total
(Worker pid=7) INFO [gpu_worker.py:760] Available KV cache memory: 8.73 GiB
(EngineCore pid=5) INFO [kv_cache_utils.py:2327] GPU KV cache size: 57,216 tokens, Maximum concurrency for 4,096 tokens per request: 13.97x
Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  50%|█████     | 34/67 [00:03<00:03, 10.1it/s]
(Worker pid=7) INFO [gpu_model_runner.py:6582] Graph capturing finished in 7 secs, took 0.55 GiB
(EngineCore pid=5) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 48.21 s
(APIServer pid=3) INFO [entry.py:140] Starting vLLM server on http://0.0.0.0:8000
"""


def _phases(log: str) -> list[str]:
    progress, seen = LoadProgress(), []
    for line in log.splitlines():
        progress.feed(line)
        if not seen or seen[-1] != progress.phase:
            seen.append(progress.phase)
    return seen


def test_load_progress_follows_a_real_cpu_engine_start():
    assert _phases(CPU_LOG) == ["starting", "loading_weights", "weights_loaded",
                                "profiling_kv_cache", "graph_capture", "server_up"]
    progress = LoadProgress()
    for line in CPU_LOG.splitlines()[:6]:
        progress.feed(line)
    assert (progress.phase, progress.shards_done, progress.shards_total) == ("weights_loaded", 1, 1)
    assert progress.weights_seconds == 0.01


def test_load_progress_follows_a_gpu_engine_start_and_never_goes_back():
    assert _phases(GPU_LOG) == ["loading_weights", "weights_loaded", "profiling_kv_cache",
                                "graph_capture", "server_up"]
    progress = LoadProgress()
    for line in GPU_LOG.splitlines():
        progress.feed(line)
        if "init engine" in line:
            assert (progress.percent, progress.init_seconds) == (95, 48.21)
    progress.feed("Loading safetensors checkpoint shards:  50% Completed | 32/64")
    assert (progress.phase, progress.percent) == ("server_up", 100)


def test_load_progress_estimates_time_left_from_the_shard_rate():
    progress = LoadProgress()
    progress.feed("Loading safetensors checkpoint shards:   0% Completed | 0/64 [00:00<?, ?it/s]", now=100.0)
    assert progress.seconds_left is None
    progress.feed("Loading safetensors checkpoint shards:  34% Completed | 22/64 [00:10<00:20]", now=110.0)
    assert progress.phase == "loading_weights"
    assert progress.percent == 5 + 55 * 34 // 100
    assert progress.seconds_left == pytest.approx(42 * 10 / 22)
    assert progress.last_activity == 110.0
    assert progress.idle_s(now=140.0) == 30.0


def test_a_second_weights_bar_gets_its_own_rate_for_the_time_left():
    """A draft model's weights after the target's (another bar, counted from 0 again): its time left comes from its
    own rate, not from the first bar's start (which read as no progress and left the page without an estimate)."""
    progress = LoadProgress()
    for now, done in ((100.0, 0), (110.0, 4), (120.0, 8)):
        progress.feed(f"Loading safetensors checkpoint shards: {done * 100 // 8}% Completed | {done}/8 [00:10<00:10]",
                      now=now)
    progress.feed("Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]", now=130.0)
    progress.feed("Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:30<00:30]", now=160.0)
    assert progress.seconds_left == pytest.approx(30.0)


def test_load_progress_reads_tqdm_updates_joined_by_carriage_returns():
    progress = LoadProgress()
    progress.feed("Loading safetensors checkpoint shards:   0% Completed | 0/4\r"
                  "Loading safetensors checkpoint shards:  50% Completed | 2/4\r")
    assert (progress.shards_done, progress.shards_total, progress.shard_percent) == (2, 4, 50)


def test_load_progress_keeps_the_first_error_not_warnings_that_mention_one():
    progress = LoadProgress()
    progress.feed("(APIServer pid=13703) WARNING 11-29 13:23:44 [system_utils.py:255] Found ulimit of 20000 "
                  "and failed to automatically increase. This can cause fd limit errors like "
                  "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n")
    assert progress.error is None
    # Recorded when vLLM 0.32's CPU worker died of SIGILL on its first request.
    progress.feed("(EngineCore pid=17397) ERROR 11-29 13:27:56 [multiproc_executor.py:315] Worker proc "
                  "VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.")
    progress.feed("(EngineCore pid=17397) ERROR 11-29 13:27:56 [core.py:1512] RuntimeError: cancelled")
    assert progress.error.startswith("Worker proc VllmWorker-0 died unexpectedly (exit code: -4)")


def test_load_progress_reads_a_bare_traceback_line():
    progress = LoadProgress()
    progress.feed("    raise self._exception")
    progress.feed("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert progress.error == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_read_lines_returns_only_complete_lines_and_resumes(tmp_path):
    log = tmp_path / "engine.log"
    assert processlog.read_lines(log, 0) == ([], 0)
    log.write_bytes(b"one\ntwo\nthr")
    lines, offset = processlog.read_lines(log, 0)
    assert (lines, offset) == (["one", "two"], 8)
    with open(log, "ab") as f:
        f.write(b"ee\n")
    assert processlog.read_lines(log, offset) == (["three"], 14)


def test_tail_returns_the_last_lines(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert processlog.tail(log, 3) == ["line 99997", "line 99998", "line 99999"]
    assert processlog.tail(tmp_path / "missing.log") == []
