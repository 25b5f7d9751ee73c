"""A sweep in a child process under a memory limit: its levels and ticks come back as they
happen, and a run that outgrows the limit fails with a clear error while its caller and the server
carry on."""
import json
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from benchmarks.runner import LoadSpec, MemoryLimitError, RunnerError, sweep_in_child
from deployments.host import processes
from tests.schedserver import SchedServer

MIB = 2**20


def test_levels_and_ticks_come_back_while_the_child_runs():
    with SchedServer(ttft_ms=20, gap_ms=20) as server:
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="builtin", max_tokens=20,
                        levels=(1, 2), min_requests=4, requests_per_user=2, tick_s=0.1, workers=1)
        seen = []
        result = sweep_in_child(spec, on_level=lambda lv: seen.append(("level", lv.concurrency, time.monotonic())),
                                on_tick=lambda t: seen.append(("tick", t.concurrency, time.monotonic())),
                                memory_bytes=512 * MIB)
    assert [lv.concurrency for lv in result.levels] == [1, 2] and not result.cancelled
    assert all(lv.completed == 4 and lv.output_tokens == 80 and not lv.records for lv in result.levels)
    assert len(result.levels[0].samples["ttft_ms"]) == 4  # what a study's statistics need, without the records
    first_level = next(i for i, event in enumerate(seen) if event[0] == "level")
    # Live: level 1's ticks came before its point, level 2's after it.
    assert {c for kind, c, _ in seen[:first_level] if kind == "tick"} == {1}
    assert {c for kind, c, _ in seen[first_level:] if kind == "tick"} == {2}


def test_a_cancel_reaches_the_child():
    with SchedServer(ttft_ms=10, gap_ms=200) as server:  # ~20 s per request
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="builtin", max_tokens=100,
                        levels=(2,), min_requests=4, tick_s=0.1, workers=1)
        stop = threading.Event()
        threading.Timer(1.0, stop.set).start()
        result = sweep_in_child(spec, cancel=stop, memory_bytes=512 * MIB)
        sent = server.server.generation_tokens_total
    # The child stopped its requests: the server had sent a few of their 2 x 100 tokens (one per 200 ms), not all
    # (a count, not the wall time: a busy host may take seconds to deliver the cancel).
    assert result.cancelled and sent < 2 * 100 / 2, sent


def test_a_run_that_outgrows_the_memory_limit_fails_and_the_server_keeps_serving():
    """400 requests of 5,000 one-token chunks: two million timestamps (~64 MiB in lists, more while they
    are merged and summarised) against 128 MiB, streamed as fast as a core allows (a few seconds)."""
    with SchedServer(zero_delay=True, reasoning_tokens=0) as server:
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="builtin", max_tokens=5000,
                        levels=(8,), min_requests=400, warmup_per_user=0, tick_s=0.5, workers=1)
        with pytest.raises(MemoryLimitError, match=r"reached its memory limit \(128 MiB\)|died at its memory limit") as error:
            sweep_in_child(spec, memory_bytes=128 * MIB)
        assert error.value.permanent
        with urllib.request.urlopen(f"{server.base_url}/v1/models", timeout=5) as answer:
            assert json.load(answer)["data"][0]["id"] == "sched"
        # And a run within the limit still goes through, at once.
        small = sweep_in_child(LoadSpec(**{**spec.__dict__, "max_tokens": 50, "min_requests": 16}), memory_bytes=128 * MIB)
    assert small.levels[0].completed == 32  # 4 per stream


def test_a_server_that_cannot_take_the_lengths_is_refused_before_any_request():
    with SchedServer() as server:  # it lists a max_model_len of 1,048,576
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="random", input_tokens=1 << 20,
                        max_tokens=16, levels=(1,), min_requests=1, workers=1)
        with pytest.raises(RunnerError, match="1048576 \\+ 16 = 1048592, more than the max model length 1048576 of sched") as error:
            sweep_in_child(spec, memory_bytes=512 * MIB)
    assert error.value.permanent


def test_a_child_killed_mid_run_leaves_no_semaphore_in_dev_shm():
    """The measuring processes share queues, an event and a barrier: named POSIX semaphores in
    /dev/shm (sem.mp-*), which Python's resource tracker unlinks when their owner dies. A caller whose
    callback fails kills the child's whole session: the tracker must not die with it, and what it
    could not unlink the caller does. (Only the child's own files count: other runs make theirs meanwhile.)"""
    with SchedServer(ttft_ms=10, gap_ms=200) as server:  # ~20 s per request: the kill lands mid-level
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="builtin", max_tokens=100,
                        levels=(2,), min_requests=4, tick_s=0.1, workers=1)
        held = set()

        def tick(_):
            for child in psutil.Process().children():
                try:
                    command = " ".join(child.cmdline())
                except psutil.Error:  # another test's child that ended and is not reaped yet
                    continue
                if "benchmarks.runner.child" in command:
                    held.update(p for p in processes.shm_files(child.pid) if Path(p).name.startswith("sem.mp-"))
            if held:
                raise KeyboardInterrupt  # a failing callback, Ctrl-C: the caller kills the child at once

        with pytest.raises(KeyboardInterrupt):
            sweep_in_child(spec, on_tick=tick, memory_bytes=512 * MIB)
    assert held, "the measuring processes held no named semaphore: this test checks nothing"
    left = sorted(p for p in held if Path(p).exists())
    assert left == [], f"the killed child left {left} in /dev/shm"
