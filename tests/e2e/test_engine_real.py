"""End to end: a real vLLM (CPU build, scripts/install-engine) serving the tiny test model."""
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from deployments.host import processes, processlog, serveargv, vllm
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
ENGINE_VENV = Path(os.environ.get("ENGINE_VENV", ROOT / ".engine-venv"))
VLLM = ENGINE_VENV / "bin" / "vllm"
START_TIMEOUT_S = 300  # ~25-45 s alone on 2 cores; slower when other tests share them

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM.exists(), reason=f"no engine at {VLLM}: run scripts/install-engine"),
]


@dataclass
class Server:
    handle: processes.EngineHandle
    base_url: str
    port: int
    log_path: Path
    phases: list[str]
    progress: processlog.LoadProgress
    start_s: float


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    port = free_port()
    argv = serveargv.build_argv(str(VLLM), str(tiny_model), port, "127.0.0.1", {
        "enforce-eager": True, "max-model-len": 1024, "served-model-name": "tiny",
        "reasoning-parser": "qwen3",
    })
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp / "vllm-cache")}
    log_path = tmp / "engine.log"
    started = time.monotonic()
    handle = processes.launch(processes.EngineSpec(argv, env, log_path, cwd=tmp))
    base_url = f"http://127.0.0.1:{port}"
    progress, phases, offset = processlog.LoadProgress(), ["starting"], 0
    try:
        while True:
            lines, offset = processlog.read_lines(log_path, offset)
            for line in lines:
                progress.feed(line)
                if progress.phase != phases[-1]:
                    phases.append(progress.phase)
            if progress.phase == "server_up" and vllm.health(base_url):
                break
            if not processes.alive(handle.pid, handle.create_time):
                pytest.fail("engine exited while starting:\n" + "\n".join(processlog.tail(log_path, 40)))
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"engine not up after {START_TIMEOUT_S} s in phase {progress.phase}:\n"
                            + "\n".join(processlog.tail(log_path, 40)))
            time.sleep(0.2)
        yield Server(handle, base_url, port, log_path, phases, progress, time.monotonic() - started)
    finally:
        processes.stop(handle.pgid, term_timeout_s=5.0)


def test_load_progress_sees_every_phase_of_a_real_start(server):
    print(f"engine up in {server.start_s:.1f} s, phases {server.phases}")
    assert server.phases == ["starting", "loading_weights", "weights_loaded", "profiling_kv_cache",
                             "graph_capture", "server_up"]
    assert (server.progress.shards_done, server.progress.shards_total) == (1, 1)
    assert server.progress.weights_seconds is not None and server.progress.init_seconds is not None
    assert server.progress.percent == 100 and server.progress.error is None
    assert vllm.health(server.base_url)
    assert not processes.port_free("127.0.0.1", server.port)


def test_smoke_test_gets_a_reply_with_reasoning_and_token_counts(server):
    # The prompt is ~20 tokens: on this CPU a 3-token first request killed vLLM 0.32's worker (SIGILL).
    result = vllm.smoke_test(server.base_url, "tiny", max_tokens=32)
    assert result.reply or result.reasoning
    assert result.prompt_tokens > 5 and 0 < result.completion_tokens <= 32
    assert result.reasoning_tokens is not None  # a reasoning parser is on
    assert vllm.served_models(server.base_url) == ["tiny"]


def test_a_metrics_reading_counts_the_generated_tokens(server):
    url = vllm.metrics_url(server.base_url)
    before = (time.monotonic(), vllm.read_metrics(url))
    assert before[1]["num_requests_running"] == 0 and 0 <= before[1]["kv_cache_usage_perc"] <= 1
    generated = vllm.smoke_test(server.base_url, "tiny", max_tokens=8).completion_tokens
    deadline = time.monotonic() + 10  # the engine may record its stats just after answering
    while True:
        after = (time.monotonic(), vllm.read_metrics(url))
        rise = after[1]["generation_tokens_total"] - before[1]["generation_tokens_total"]
        if rise >= generated or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert generated > 0 and rise == generated
    assert vllm.tok_s(before, after) == pytest.approx(rise / (after[0] - before[0]))


def test_engine_flags_come_from_the_engine_and_catch_typos(server):
    flags = serveargv.engine_flags(str(VLLM))
    assert {"--tensor-parallel-size", "--max-model-len", "--enforce-eager", "--reasoning-parser"} <= flags
    errors = serveargv.validate_args({"tensor-paralel-size": 2, "max-model-len": 2048}, flags)
    assert list(errors) == ["tensor-paralel-size"]
    assert "did you mean --tensor-parallel-size?" in errors["tensor-paralel-size"]


def test_stop_leaves_no_process_no_shm_file_and_a_free_port(server):
    pgid = server.handle.pgid
    group = processes.members(pgid)
    assert len(group) >= 3  # API server, EngineCore, Worker (and Python's resource tracker)
    held = processes.shm_files(pgid)
    assert held and all(path.startswith("/dev/shm/psm_") for path in held)
    # SIGTERM then SIGKILL at once: the hard path, as when a stream keeps the API server waiting.
    result = processes.stop(pgid, term_timeout_s=0.0, kill_timeout_s=15.0)
    print(f"stop: {result}")
    assert result.signals_sent == ["SIGTERM", "SIGKILL"]
    assert result.survivors == [] and processes.members(pgid) == []
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in group)
    assert not any(Path(path).exists() for path in held)
    assert processes.port_free("127.0.0.1", server.port)
    assert not vllm.health(server.base_url, timeout=1.0)
