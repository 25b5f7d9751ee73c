"""The memory cap, with real processes: a Celery worker runs benchmarks as the node agent does
(benchmarks.services.run_execute), its load generator limited to 128 MiB by PANEL_BENCH_MEMORY_MB,
against an OpenAI-compatible server that streams as fast as a core allows (tests/schedserver.py). A run
that passes every cap but outgrows that limit fails with a clear message; the worker lives on and runs
the next benchmark; the server never stopped answering."""
import sys
import urllib.request

import pytest

from benchmarks.models import BenchmarkRun
from tests.conftest import wait_until
from tests.schedserver import SchedServer

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def control_worker(process_env, spawn, unique):
    env = dict(process_env, PANEL_BENCH_MEMORY_MB="128")
    argv = [sys.executable, "-m", "celery", "-A", "controlpanel", "worker", "-Q", "control", "-n", f"control-{unique}@%h",
            "--pool", "threads", "--concurrency", "2", "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
    return spawn(argv, env, name="control-worker")


def _finished(pk):
    run = BenchmarkRun.objects.get(pk=pk)
    return run if run.status in BenchmarkRun.TERMINAL else None


def test_a_run_that_outgrows_the_memory_limit_fails_cleanly_and_the_server_keeps_serving(api, control_worker, settings):
    with SchedServer(zero_delay=True, reasoning_tokens=0) as server:
        settings.BENCHMARK_URL_ALLOWLIST = [server.base_url]
        # 400 requests of 5,000 tokens at concurrency 8: 2 million chunk timestamps, far within the caps
        # (400 requests per level, a few hundred KiB of prompts), not within 128 MiB.
        big = api.post("/api/runs/", {"base_url": server.base_url, "levels": [8], "prompt_source": "builtin",
                                      "max_tokens": 5000, "min_requests": 400, "warmup_per_user": 0}, format="json")
        assert big.status_code == 202, big.content
        run = wait_until(lambda: _finished(big.json()["id"]), timeout=180, message="the big run to end")
        assert run.status == "failed", (run.status, run.error)
        assert run.error.startswith("The benchmark ran out of memory: the load generator ") and "(128 MiB)" in run.error
        assert "The engine was not affected" in run.error and "PANEL_BENCH_MEMORY_MB" in run.error
        assert not run.points.exists()
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=5) as answer:
            assert answer.status == 200
        assert control_worker.poll() is None  # the process that started the load is alive
        small = api.post("/api/runs/", {"base_url": server.base_url, "levels": [8], "prompt_source": "builtin",
                                        "max_tokens": 50, "min_requests": 16, "warmup_per_user": 0}, format="json")
        run = wait_until(lambda: _finished(small.json()["id"]), timeout=120, message="the next run to end")
    assert run.status == "done", run.error
    point = run.points.get()
    assert point.num_requests == 32 and point.failed_requests == 0
