"""The engines the vLLM conformance checks run against: the real CPU vLLM and every double that stands in for a
whole vLLM server. Each is started once per module, the way the panel starts engines (its key in VLLM_API_KEY,
VLLM_SERVER_DEV_MODE=1 for the sleep routes), and stopped with its whole process group.

The real engine's tests carry the e2e marker (`./panel test --fast` leaves them out); the doubles' tests need no
engine venv and stay in the fast tier."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

from deployments.host import processes
from tests.conftest import ROOT, VLLM, _lock_file, free_port

KEY = "conformance-engine-key-0123456789"
SERVED = "tiny"
MAX_MODEL_LEN = 2048
FAKE = ROOT / "tests" / "faults" / "fakevllm"
START_TIMEOUT_S = {"vllm": 300.0}  # the real engine loads in 20-60 s on 2 shared cores; a double in about a second
REAL = pytest.param("vllm", marks=[pytest.mark.e2e, pytest.mark.timeout(900)])
# The real one first: what it does is what the doubles are held to.
ENGINES = [REAL, "fakevllm", "standin", "schedserver"]


@dataclass
class Engine:
    name: str
    cli: list[str]  # how to run its `vllm`
    model: str
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def call(engine: Engine, method: str, path: str, body: dict | None = None, key: str | None = KEY,
         timeout: float = 120.0) -> tuple[int, bytes, Message]:
    """(status, body, headers: case-insensitive) of one request; `key` None sends no Authorization header."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(engine.base_url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def _cli(name: str, folder: Path) -> list[str]:
    if name == "vllm":
        return [str(VLLM)]
    if name != "standin":
        return [str(FAKE / "vllm")]
    # As tests/gpu/test_whole_panel_gpu.py installs it: the stand-in as `vllm`, the fake and its files beside it.
    bin_dir = folder / "standin-bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(f"#!{sys.executable}\n" + (ROOT / "tests" / "gpu" / "standin_vllm.py").read_text())
    vllm.chmod(0o755)
    shutil.copy(FAKE / "vllm", bin_dir / "fakevllm")
    for extra in FAKE.iterdir():
        if extra.name != "vllm" and extra.is_file():
            shutil.copy(extra, bin_dir / extra.name)
    return [str(vllm)]


def _model(name: str, folder: Path, request) -> str:
    if name == "vllm":
        return str(request.getfixturevalue("tiny_model"))
    model = folder / "model"
    model.mkdir()
    config: dict = {"load_s": 0.2}
    if name == "standin":
        config["gpu_gib"] = 0  # its GPU-less rehearsal mode: the core child holds no GPU memory
    if name == "schedserver":  # the fake's load, then tests/schedserver.py serving HTTP
        config |= {"python": sys.executable, "schedules": {"*": {"ttft_ms": 2, "gap_ms": 1}}}
    (model / "fake_engine.json").write_text(json.dumps(config))
    return str(model)


@contextlib.contextmanager
def _engines_lock():
    """The real engine shares this run's engine lock (tests/conftest.py _alone_or_beside) for as long as it runs."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    with _lock_file(run, "engines") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        yield


def start(name: str, folder: Path, request, cli: list[str] | None = None, model: str | None = None) -> Engine:
    cli = cli or _cli(name, folder)
    model = model or _model(name, folder, request)
    port = free_port()
    argv = [*cli, "serve", model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED,
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    env = dict(os.environ, VLLM_API_KEY=KEY, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CACHE_ROOT=str(folder / "vllm-cache"))
    log_path = folder / f"engine-{port}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=folder, start_new_session=True)
    engine = Engine(name, cli, model, proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + START_TIMEOUT_S.get(name, 60.0)
    while True:
        try:
            if call(engine, "GET", "/health", key=None, timeout=2)[0] == 200:
                return engine
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(engine)
            pytest.fail(f"{name} did not come up (exit {proc.returncode}):\n{engine.log_tail()}")
        time.sleep(0.2)


def stop(engine: Engine) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        processes.stop(engine.proc.pid, term_timeout_s=5, kill_timeout_s=5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        engine.proc.wait(5)


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tmp_path_factory):
    """One engine of ENGINES, up and serving, for the whole module. The real one is run, never skipped: `./panel
    test` installs it, and a suite that skipped it would hold the doubles to nothing."""
    if request.param == "vllm":
        assert VLLM.exists(), "scripts/install-engine installs the CPU engine (./panel test runs it first)"
    folder = tmp_path_factory.mktemp(f"engine-{request.param}")
    with _engines_lock() if request.param == "vllm" else contextlib.nullcontext():
        started = start(request.param, folder, request)
        try:
            yield started
        finally:
            stop(started)
