"""The GPU log corpus (tests/fixtures/gpu_logs/, tests/gpucorpus.py) through the panel's own parsers, for every weights
loader: a TP=8 DeepSeek-V3-architecture load of ~36 minutes as vLLM 0.32's CUDA build prints it. Each line is fed with
its corpus time as `now` (no sleeping): the phases in order, the weights fraction, the ETA against the corpus's true
remaining time, and the stall rule (LoadProgress.stalled, which plan._follow applies: neither the log nor GPU memory
moved for stall_seconds)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.contextfit import EngineKv, GiB
from deployments.host import processlog, vllm
from deployments.host.loadphases import PhaseClock, predict, replay
from deployments.host.processlog import LoadProgress
from tests import gpucorpus
from tests.conftest import free_port

STALL_S = 600  # the deploy form's default stall_seconds
BARRED = [loader for loader in gpucorpus.LOADERS if loader != "sharded_state"]


def lines(loader):
    return gpucorpus.read(gpucorpus.path(loader))


def weights_span(corpus):
    """The corpus's own weights phase: 'Starting to load model' to the last rank's 'Loading weights took'."""
    start = next(t for t, line in corpus if "Starting to load model" in line)
    end = max(t for t, line in corpus if "Loading weights took" in line)
    return start, end


def test_the_corpus_is_what_the_generator_writes():
    for loader in gpucorpus.LOADERS:
        assert gpucorpus.path(loader).read_text() == gpucorpus.corpus(loader), "run python -m tests.gpucorpus write"


@pytest.mark.parametrize("loader", gpucorpus.LOADERS)
def test_every_line_carries_vllms_prefix_or_is_tqdm_or_uvicorn(loader):
    for _, line in lines(loader):
        assert (processlog._LOG_PREFIX_RE.match(line)["level"] or gpucorpus._BAR.search(line)
                or line.startswith("INFO:     ") or "[RunAI Streamer]" in line), line


@pytest.mark.parametrize("loader", gpucorpus.LOADERS)
def test_the_phase_clock_sees_each_phase_in_order_and_the_load_takes_36_minutes(loader):
    corpus = lines(loader)
    clock = PhaseClock()
    for t, line in corpus:
        clock.feed(line, t)
    clock.finish(corpus[-1][0])
    # torch.compile runs inside the profiling run: the seconds between the weights' end and the compile's
    # (back-dated) start are that run's, hence KV cache on both sides of the compile (as test_loadphases has it).
    assert [p for p, _, _ in clock.segments] == ["process", "p2p_check", "weights", "kv_cache", "compile",
                                                 "kv_cache", "graph_capture", "api_up"], clock.segments
    assert clock.segments[3][2] - clock.segments[3][1] < 45  # sharded_state: the first rank's end ends the weights
    totals = clock.totals()
    start, end = weights_span(corpus)
    assert totals["weights"] == pytest.approx(end - start, rel=0.05)
    assert totals["compile"] == pytest.approx(109.47, rel=0.1)  # torch.compile's own total
    assert 150 < totals["graph_capture"] < 200
    assert 34 * 60 < corpus[-1][0] < 37 * 60
    assert clock.weights_s == pytest.approx(1744, abs=25)
    # The same log replayed by its own HH:MM:SS stamps (1 s resolution) splits the same way.
    by_stamp = replay([line for _, line in corpus]).totals()
    assert by_stamp["weights"] == pytest.approx(totals["weights"], abs=3)


@pytest.mark.parametrize("loader", gpucorpus.LOADERS)
def test_the_logs_progress_goes_through_each_phase_to_server_up(loader):
    progress, phases = LoadProgress(), []
    for t, line in lines(loader):
        progress.feed(line, now=t)
        if not phases or phases[-1] != progress.phase:
            phases.append(progress.phase)
    want = ["starting", "loading_weights", "weights_loaded", "profiling_kv_cache", "graph_capture", "server_up"]
    assert phases == want
    assert progress.percent == 100 and progress.error is None
    assert progress.weights_seconds == pytest.approx(1744, abs=25)


@pytest.mark.parametrize("loader", BARRED)
def test_the_weights_fraction_moves_with_each_bar_line_and_the_eta_is_near_the_true_time_left(loader):
    corpus = lines(loader)
    _, end = weights_span(corpus)
    progress, last_done, ratios = LoadProgress(), -1, []
    for t, line in corpus:
        progress.feed(line, now=t)
        if gpucorpus._BAR.search(line) and "Capturing" not in line:
            assert progress.phase == "loading_weights" and progress.shards_done > last_done
            last_done = progress.shards_done
            assert 5 <= progress.percent <= 60
            if progress.shards_done / progress.shards_total >= 0.25 and t < end - 60:
                ratios.append(progress.seconds_left / (end - t))  # corpus timestamps, as below: no clock is read
    assert last_done == progress.shards_total
    assert ratios and all(0.7 < r < 1.4 for r in ratios), ratios


@pytest.mark.parametrize("loader", gpucorpus.LOADERS)
def test_the_prediction_from_an_earlier_same_load_is_near_the_true_time_to_ready_from_the_first_shard_on(loader):
    """From the first bar update that moved on, the time left is within a third of the truth during the weights
    (the rate of the bar so far: the model's initialisation before the first byte read is not weights time), and
    within a minute after them (the earlier load's phases)."""
    corpus = lines(loader)
    ready = next(t for t, line in corpus if "Starting vLLM server" in line)
    earlier = PhaseClock()
    for t, line in corpus:
        earlier.feed(line, t)
    earlier.finish(ready)
    history = [earlier.totals()]
    clock, checked = PhaseClock(), 0
    for t, line in corpus:
        clock.feed(line, t)
        if t >= ready:
            break
        p = predict(clock, t, history, "same key, 1 load")
        if clock.phase == "weights" and clock.shards_done:
            # Both sides are the corpus's own timestamps (seconds since launch, written in the file), not a clock of
            # this machine: the prediction against the recorded truth, the same on every run.
            assert 0.75 < p.seconds_left / (ready - t) < 1.33, (t, line, p)
            checked += 1
        elif clock.weights_s is not None:
            assert abs(p.seconds_left - (ready - t)) < 60, (t, line, p)
    assert checked == 0 if loader == "sharded_state" else checked > 7  # sharded_state: no bar to follow


# GPU memory that never moves after launch: the log alone must keep a load alive (plan._follow's rule is
# LoadProgress.stalled: neither the log nor GPU memory moved for stall_seconds).
FROZEN = 0.0


@pytest.mark.parametrize("loader", BARRED)
def test_a_replay_with_bars_never_idles_long_enough_to_look_stalled(loader):
    corpus = lines(loader)
    assert max(b - a for (a, _), (b, _) in zip(corpus, corpus[1:])) < STALL_S / 2
    progress = LoadProgress()
    for (t, line), (t_next, _) in zip(corpus, corpus[1:]):
        progress.feed(line, now=t)
        assert progress.stalled(t_next, FROZEN, STALL_S) is None, (t, line)


def test_the_sharded_state_loader_prints_nothing_while_it_reads_so_only_gpu_memory_keeps_it_alive():
    """ShardedStateLoader.load_weights has no progress bar: ~29 minutes without a line. The log alone would call it
    stalled after STALL_S; the weights filling GPU memory (63.7 GiB in ~29 min: 64 MiB every ~2 s) keep it alive. The
    page shows no fraction and no ETA for it."""
    corpus = lines("sharded_state")
    before = [(t, line) for t, line in corpus if t < 600]
    progress = LoadProgress()
    for t, line in before:
        progress.feed(line, now=t)
    last, following = before[-1][0], corpus[len(before)][0]
    assert progress.phase == "loading_weights" and progress.shards_total == 0 and progress.percent == 5
    assert progress.seconds_left is None
    assert following - last > 2 * STALL_S  # the next line: the first rank's "Loading weights took"
    for now in range(int(last) + STALL_S + 1, int(following), 60):
        assert progress.stalled(now, now - 2.0, STALL_S) is None  # memory moving
        assert progress.stalled(now, FROZEN, STALL_S) == pytest.approx(now - last)  # memory stuck too


def test_a_load_cut_in_the_weights_phase_is_stalled_after_stall_seconds():
    corpus = lines("safetensors")
    cut = [(t, line) for t, line in corpus if t < 900]
    progress = LoadProgress()
    for t, line in cut:
        progress.feed(line, now=t)
    last = cut[-1][0]
    assert progress.phase == "loading_weights" and 0 < progress.shards_done < progress.shards_total
    assert progress.stalled(last + STALL_S - 1, FROZEN, STALL_S) is None
    assert progress.stalled(last + STALL_S + 1, FROZEN, STALL_S) == pytest.approx(STALL_S + 1)


def test_the_attention_backend_line_is_vllms_own():
    text = [line for _, line in lines("safetensors") if "attention backend" in line]
    assert text and "Using TRITON_MLA attention backend out of potential backends:" in text[0]


def test_the_gpu_stand_in_replays_a_whole_load_at_1000x_and_the_panels_follower_reads_its_phases(tmp_path):
    """tests/gpu/standin_vllm.py with "replay" in fake_engine.json, on a machine without a GPU (gpu_gib 0): the
    fastsafetensors load (~35 minutes) in ~2 s, read as the agent reads an engine log, then /health answers."""
    root = Path(gpucorpus.__file__).parent
    engine = tmp_path / "engine"
    engine.mkdir()
    shutil.copy(root / "gpu" / "standin_vllm.py", engine / "vllm")
    shutil.copy(root / "faults" / "fakevllm" / "vllm", engine / "fakevllm")
    for extra in ("fakeproto.py", "serve-flags.txt"):  # the fake's own files, beside it
        shutil.copy(root / "faults" / "fakevllm" / extra, engine / extra)
    shutil.copy(root / "gpucorpus.py", engine / "gpucorpus.py")
    model = tmp_path / "model"
    model.mkdir()
    (model / "fake_engine.json").write_text(json.dumps({
        "load_s": 0.2, "gpu_gib": 0, "replay": str(gpucorpus.path("fastsafetensors")), "replay_speed": 1000}))
    port = free_port()
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        argv = [sys.executable, str(engine / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        progress, offset, phases, fractions = LoadProgress(), 0, [], []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            new, offset = processlog.read_lines(log, offset)
            for line in new:
                progress.feed(line)
                if not phases or phases[-1] != progress.phase:
                    phases.append(progress.phase)
                if progress.phase == "loading_weights" and progress.shards_total == 8:
                    fractions.append(progress.shards_done)
            if progress.phase == "server_up" and vllm.health(f"http://127.0.0.1:{port}", timeout=1.0):
                break
            time.sleep(0.05)
        assert vllm.health(f"http://127.0.0.1:{port}", timeout=1.0), log.read_text()[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    assert phases == ["starting", "loading_weights", "weights_loaded", "profiling_kv_cache", "graph_capture",
                      "server_up"]
    assert fractions[-1] == 8 and fractions == sorted(fractions)
    assert b"\r" in log.read_bytes()  # bar updates end with \r, as in the engine's own log file


# Where the engine core relays its workers' output (seen in real vLLM logs of early 2026), a worker's line carries both
# names: "(EngineCore_DP0 pid=20129) (Worker_TP0 pid=20135) INFO 02-15 05:16:38 [...] ...".
NESTED = "(EngineCore_DP0 pid=20129) (Worker_TP0 pid=20135) "


def test_a_worker_line_relayed_by_the_engine_core_keeps_its_level_stamp_and_error():
    progress = LoadProgress()
    progress.feed(NESTED + "ERROR 02-15 05:16:38 [gpu_worker.py:310] CUDA out of memory. Tried to allocate 2.00 GiB",
                  now=1.0)
    assert progress.error == "CUDA out of memory. Tried to allocate 2.00 GiB"
    older = LoadProgress()  # the worker's name before vLLM 0.10
    older.feed("(VllmWorker rank=0 pid=158677) ERROR 07-08 02:34:28 [core.py:515] EngineCore failed to start.", now=1.0)
    assert older.error == "EngineCore failed to start."
    corpus = [line for _, line in lines("safetensors")]
    nested = [NESTED + line.split(") ", 1)[1] if line.startswith("(Worker_TP") else line for line in corpus]
    assert replay(nested).totals()["weights"] == pytest.approx(replay(corpus).totals()["weights"], abs=1)


@pytest.mark.parametrize("loader", gpucorpus.LOADERS)
def test_the_engines_kv_cache_figures_are_read_for_the_context_fit(loader):
    kv = EngineKv.from_lines([line for _, line in lines(loader)])
    assert (kv.device, kv.tokens, kv.kv_bytes) == ("GPU", 151_552, int(9.87 * GiB))


def test_a_second_weights_bar_starts_its_own_rate():
    """A draft model's weights (speculative decoding) come with a bar of their own after the target's."""
    clock, history = PhaseClock(), [{"weights": 100.0}]
    desc = "Loading safetensors checkpoint shards"
    clock.feed(f"{desc}:   0% Completed | 0/64 [00:00<?, ?it/s]", 10.0)
    clock.feed(f"{desc}: 100% Completed | 64/64 [10:00<00:00, 9.38s/it]", 610.0)
    clock.feed(f"{desc}:   0% Completed | 0/2 [00:00<?, ?it/s]", 611.0)
    clock.feed(f"{desc}:  50% Completed | 1/2 [00:05<00:05, 5.00s/it]", 616.0)
    assert predict(clock, 616.0, history, "x").seconds_left == pytest.approx(5.0)
