"""Unit tests of deployments.host.engine (no vLLM, no database)."""
import os
import socket
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from deployments.host import engine, engineenv
from deployments.host.engine import EngineError, EngineSpec, LoadProgress

# --- argv and flags ---------------------------------------------------------------------------


def test_build_argv_turns_engine_args_into_flags_without_a_shell():
    argv = engine.build_argv("/venv/bin/vllm", "/models/llama", 8001, "0.0.0.0", {
        "tensor-parallel-size": 8, "enforce-eager": True, "max-model-len": 4096,
        "enable-prefix-caching": False, "kv-cache-dtype": None,
        "allowed-origins": ["a", "b"], "speculative-config": {"method": "ngram"},
        "served_model_name": "m; rm -rf /",
    })
    assert argv == [
        "/venv/bin/vllm", "serve", "/models/llama", "--host", "0.0.0.0", "--port", "8001",
        "--tensor-parallel-size", "8", "--enforce-eager", "--max-model-len", "4096",
        "--allowed-origins", "a", "b", "--speculative-config", '{"method": "ngram"}',
        "--served-model-name", "m; rm -rf /",
    ]


@pytest.mark.parametrize("name", ["port", "--host", "model", "bad flag", "x=1"])
def test_build_argv_refuses_reserved_or_malformed_flags(name):
    with pytest.raises(EngineError) as err:
        engine.build_argv("vllm", "m", 8000, "127.0.0.1", {name: "1"})
    assert err.value.permanent


FLAGS = {"--tensor-parallel-size", "--enforce-eager", "--max-model-len", "--port", "--host",
         "--enable-prefix-caching", "--no-enable-prefix-caching", "--reasoning-parser"}


def test_validate_args_suggests_the_flag_a_typo_meant():
    errors = engine.validate_args(
        {"tensor-paralel-size": 2, "max_model_len": 4096, "enforce-eager": True,
         "frobnicate-everything": 1, "port": 9000}, FLAGS)
    assert set(errors) == {"tensor-paralel-size", "frobnicate-everything", "port"}
    assert "--tensor-paralel-size" in errors["tensor-paralel-size"]
    assert "did you mean --tensor-parallel-size?" in errors["tensor-paralel-size"]
    assert "did you mean" not in errors["frobnicate-everything"]
    assert "set by the panel" in errors["port"]


def test_engine_flags_parses_the_engines_own_help_once(tmp_path):
    calls = tmp_path / "calls"
    fake = tmp_path / "vllm"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo x >> {calls}
        cat <<'EOF'
        usage: vllm serve [model_tag] [options]
        options:
          --port PORT           Port number. (default: 8000)
          --grpc                Launch the gRPC server on
                                --not-a-flag instead of the HTTP server.
          --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE
          --enable-prefix-caching, --no-enable-prefix-caching
          -h, --help            show this help message and exit
        EOF
        """))
    fake.chmod(0o755)
    flags = engine.engine_flags(str(fake))
    assert flags == {"--port", "--grpc", "--tensor-parallel-size", "--enable-prefix-caching",
                     "--no-enable-prefix-caching", "--help"}
    engine.engine_flags(str(fake))
    assert calls.read_text().count("x") == 1


def test_engine_version_is_what_vllm_says_after_its_log_lines(tmp_path):
    fake = tmp_path / "vllm"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] || exit 2\n'
                    'echo "INFO 11-29 10:00:00 [__init__.py:1] Automatically detected platform cpu."\necho 0.32.0+cpu\n')
    fake.chmod(0o755)
    assert engine.engine_version(str(fake)) == "0.32.0+cpu"
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'Traceback (most recent call last):'\nexit 1\n")
    broken.chmod(0o755)
    assert engine.engine_version(str(broken)) == "" and engine.engine_version(str(tmp_path / "nope")) == ""


def test_engine_flags_of_a_missing_engine_is_a_permanent_error(tmp_path):
    with pytest.raises(EngineError) as err:
        engine.engine_flags(str(tmp_path / "nope"))
    assert err.value.permanent


# --- load progress ----------------------------------------------------------------------------

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
    assert engine.read_lines(log, 0) == ([], 0)
    log.write_bytes(b"one\ntwo\nthr")
    lines, offset = engine.read_lines(log, 0)
    assert (lines, offset) == (["one", "two"], 8)
    with open(log, "ab") as f:
        f.write(b"ee\n")
    assert engine.read_lines(log, offset) == (["three"], 14)


def test_tail_returns_the_last_lines(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert engine.tail(log, 3) == ["line 99997", "line 99998", "line 99999"]
    assert engine.tail(tmp_path / "missing.log") == []


# --- processes --------------------------------------------------------------------------------

# A leader and children that ignore SIGTERM; one child leaves the process group (not the
# session), one holds Python SharedMemory (registered with a resource tracker), one maps an
# untracked /dev/shm file.
TREE = """
import mmap, os, signal, subprocess, sys, time
from multiprocessing import shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
role, pids, raw = sys.argv[1], sys.argv[2], sys.argv[3]
def spawn(r):
    return subprocess.Popen([sys.executable, __file__, r, pids, raw]).pid
if role == "leader":
    spawn("child"); spawn("escaper")
elif role == "child":
    spawn("grandchild")
    shm = shared_memory.SharedMemory(create=True, size=4096)
    with open(pids + ".psm", "w") as f: f.write(shm.name)
elif role == "escaper":
    os.setpgid(0, 0)
    fd = os.open(raw, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096); os.close(fd)
with open(pids, "a") as f: f.write(f"{os.getpid()}\\n")
while True: time.sleep(1)
"""


@pytest.fixture
def launch_tree(tmp_path):
    """Start TREE; whatever a failing test leaves is stopped and unlinked afterwards."""
    raw, handles = f"/dev/shm/enginetest_{uuid.uuid4().hex}", []
    yield lambda ignore_term=True: _launch_tree(tmp_path, raw, handles, ignore_term)
    for handle in handles:
        engine.stop(handle.pgid, term_timeout_s=0.1)
    Path(raw).unlink(missing_ok=True)


def _launch_tree(tmp_path, raw, handles, ignore_term):
    pids = tmp_path / "pids"
    code = TREE if ignore_term else TREE.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN)", "")
    script = tmp_path / "tree.py"
    script.write_text(code)
    argv = [sys.executable, str(script), "leader", str(pids), raw]
    handle = engine.launch(EngineSpec(argv, {"ENGINE_TEST": "1"}, tmp_path / "tree.log"))
    handles.append(handle)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if pids.exists() and len(pids.read_text().split()) == 4 and Path(raw).exists():
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"tree did not start: {engine.tail(tmp_path / 'tree.log')}")
    psm = "/dev/shm/" + (tmp_path / "pids.psm").read_text().lstrip("/")
    return handle, [int(p) for p in pids.read_text().split()], psm, raw


def test_stop_escalates_to_sigkill_and_leaves_no_process_or_shm_file(launch_tree):
    handle, pids, psm, raw = launch_tree()
    assert engine.alive(handle.pid, handle.create_time)
    assert os.getpgid(handle.pid) == handle.pgid == handle.pid
    assert psutil.Process(handle.pid).environ()["ENGINE_TEST"] == "1"
    assert set(pids) <= set(engine.members(handle.pgid))
    assert {psm, raw} <= engine.shm_files(handle.pgid)

    term_s, kill_s = 1.0, 10.0
    result = engine.stop(handle.pgid, term_timeout_s=term_s, kill_timeout_s=kill_s)

    assert result.signals_sent == ["SIGTERM", "SIGKILL"]
    assert result.survivors == [] and engine.members(handle.pgid) == []
    # Relations to its own deadlines: KILL only after TERM's deadline, and done before KILL's ran out.
    assert term_s <= result.seconds < term_s + kill_s
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert not engine.alive(handle.pid, handle.create_time)
    # The resource tracker unlinks the SharedMemory; stop() removes the untracked file.
    assert not Path(psm).exists() and not Path(raw).exists()
    assert raw in result.shm_removed


def test_stop_of_a_group_that_obeys_sigterm_sends_nothing_more(launch_tree):
    handle, pids, psm, raw = launch_tree(ignore_term=False)
    term_s = 10.0
    result = engine.stop(handle.pgid, term_timeout_s=term_s)
    assert result.signals_sent == ["SIGTERM"] and result.survivors == []
    assert result.seconds < term_s  # it returned when the group ended, not at the deadline
    assert not Path(raw).exists()
    assert engine.stop(handle.pgid).signals_sent == []


def test_stop_refuses_to_signal_its_own_process_group():
    with pytest.raises(EngineError):
        engine.stop(os.getpgrp())


def test_launch_of_a_missing_binary_is_a_permanent_error(tmp_path):
    with pytest.raises(EngineError) as err:
        engine.launch(EngineSpec([str(tmp_path / "no-vllm")], {}, tmp_path / "x.log"))
    assert err.value.permanent


def test_port_free_sees_a_listening_socket():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not engine.port_free("127.0.0.1", port)
        assert not engine.port_free("0.0.0.0", port)
    assert engine.port_free("127.0.0.1", port)



# --- environment ------------------------------------------------------------------------------


def test_a_deployments_env_is_the_offline_defaults_then_its_own_variables_then_its_gpus():
    env = engineenv.deployment_env({"NCCL_PROTO": "LL", "VLLM_NO_USAGE_STATS": "0", "CUDA_VISIBLE_DEVICES": "7"}, [2, 3])
    assert env["HF_HUB_OFFLINE"] == "1" and env["NCCL_PROTO"] == "LL"
    assert env["VLLM_NO_USAGE_STATS"] == "0"  # the deployment's own wins over the panel's default
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the GPUs it was given win over a typed value
    assert "CUDA_VISIBLE_DEVICES" not in engineenv.deployment_env({}, [])
