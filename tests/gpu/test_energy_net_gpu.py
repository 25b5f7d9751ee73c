"""Energy net of idle on a real NVIDIA GPU (benchmarks/energy.py): the GPU stand-in (tests/gpu/standin_vllm.py), run
here as a plain process on GPU 0, holds real GPU memory and computes each generated token with real bf16 matmuls
("matmul_per_token"), so a load costs real energy. Its idle draw is read as a benchmark run reads it before its first
level (energy.idle_watts, the engine loaded and serving nothing); one concurrency level of streamed chat requests is
then driven by the panel's own load generator (runner.sweep_in_child, in its child process), its joules told as the run
service tells them (the deployment's EnergyMeter read at every tick and at the level's end, the window the level's
duration back from that end). Those gross joules are held to NVML's energy counter read directly, in a thread of its
own, over the same window; net of the idle draw they are less than gross and above nothing, and the load drew more
than idle. No Django here, like the rest of this folder."""
import bisect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pynvml
import pytest

from benchmarks import energy, runner
from deployments.host import gpu
from tests.conftest import free_port, wait_until
from tests.gpu.test_whole_panel_gpu import _stand_in  # the stand-in as `vllm`, the fake and its files beside it

pytestmark = pytest.mark.gpu
KEY = "energy-net-engine-key-0123456789"
SERVED = "gpu-stand-in"
HOLD_GIB = 2  # the stand-in's "weights" on GPU 0
MATMUL_PER_TOKEN = 8  # 4096 x 4096 bf16 matmuls per generated token: about 2 ms of an H100 (standin_vllm.py)
CONCURRENCY = 8
MAX_TOKENS = 128
REQUESTS = 32  # measured, after 8 warm-up ones: about 8 s of an H100 at 8 matmuls per token
IDLE_S = 5.0  # as a run reads it (PANEL_BENCH_IDLE_S's default)
SETTLE_S = 3.0  # after the load (its cuBLAS warm-up), before the idle reading
DIRECT_EVERY_S = 0.05


def _model(base: Path) -> Path:
    folder = base / "model"
    folder.mkdir()
    (folder / "fake_engine.json").write_text(json.dumps({"load_s": 0.2, "gpu_gib": HOLD_GIB,
                                                         "matmul_per_token": MATMUL_PER_TOKEN}))
    return folder


class DirectEnergy:
    """NVML's energy counter of GPU 0 (mJ), read straight through pynvml every DIRECT_EVERY_S in a thread."""

    def __init__(self):
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.readings: list[tuple[float, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.readings.append((time.monotonic(), pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)))
            self.done.wait(DIRECT_EVERY_S)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)
        pynvml.nvmlShutdown()

    def _at(self, t: float) -> float:
        """The counter at moment `t`, between the readings either side of it."""
        times = [r[0] for r in self.readings]
        i = bisect.bisect_left(times, t)
        assert 0 < i < len(times), f"no direct readings either side of {t:.2f}"
        (t0, e0), (t1, e1) = self.readings[i - 1], self.readings[i]
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def joules(self, start: float, end: float) -> float:
        return (self._at(end) - self._at(start)) / 1000.0


def test_a_levels_joules_net_of_the_idle_draw_on_a_real_gpu(gpus, tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "engine.log"
    # GPU 0 as NVML numbers it (PCI order), the one the meter reads.
    env = dict(os.environ, VLLM_API_KEY=KEY, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES="0")
    argv = [sys.executable, str(_stand_in(tmp_path)), "serve", str(_model(tmp_path)), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED, "--max-model-len", "2048"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=tmp_path, start_new_session=True)
    direct = None
    try:
        def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the stand-in exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
            try:
                return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 180, interval=0.2, message="the GPU stand-in's /health")
        report = next(json.loads(line.split(" ", 1)[1]) for line in log_path.read_text().splitlines()
                      if line.startswith("GPU-STAND-IN "))
        assert report["gib"] >= HOLD_GIB and report["device"] != "no GPU", report
        time.sleep(SETTLE_S)

        direct = DirectEnergy()
        meter = gpu.EnergyMeter([0])  # the run service's meter, over the deployment's GPUs
        meter.read()
        idle_w, why = energy.idle_watts(meter, base_url, KEY, seconds=IDLE_S)
        assert meter.supported, "NVML's energy counter is not readable on this GPU"
        assert idle_w is not None, why
        assert 30 < idle_w < 400, idle_w  # an H100 or H200 with an engine loaded and idle: roughly 50-200 W

        levels = []

        def on_level(level: runner.LevelResult) -> None:
            levels.append((level, meter.read()))  # as the run service: the level ended just before its result came

        spec = runner.LoadSpec(base_url=base_url, model=SERVED, prompt_source="builtin", max_tokens=MAX_TOKENS,
                               levels=(CONCURRENCY,), min_requests=REQUESTS, requests_per_user=1, api_key=KEY,
                               continuous_usage_stats=True)
        result = runner.sweep_in_child(spec, on_level=on_level, on_tick=lambda tick: meter.read())
        time.sleep(2 * DIRECT_EVERY_S)  # a direct reading after the level's end
        direct.stop()
    finally:
        if direct is not None and not direct.done.is_set():
            direct.stop()
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    assert len(levels) == 1 and not result.cancelled, result
    level, end = levels[0]
    assert level.completed == level.num_requests == REQUESTS and not level.failed_requests, level.errors
    tokens, duration = level.output_tokens, level.duration_s
    assert tokens == REQUESTS * MAX_TOKENS, tokens
    start = end - duration
    gross = meter.joules(start, end)  # the run service's energy_j
    assert gross is not None, "the meter's readings do not cover the level"
    direct_j = direct.joules(start, end)
    assert abs(gross - direct_j) <= 0.05 * direct_j, (gross, direct_j)
    net = energy.net_joules(gross, idle_w, duration)  # the run service's energy_net_j
    load_w = gross / duration
    print(f"\n{gpus[0].name}: idle {idle_w:.1f} W, load {load_w:.1f} W over {duration:.2f} s at concurrency "
          f"{CONCURRENCY}; gross {gross:.1f} J, net {net:.1f} J, {tokens} tokens: {gross / tokens:.4f} J/token gross, "
          f"{net / tokens:.4f} J/token net; NVML read directly {direct_j:.1f} J")
    assert 0 < net < gross, (net, gross)
    assert load_w > idle_w, (load_w, idle_w)
