"""Energy per benchmark level on a real NVIDIA GPU: the meter the benchmark runs use (deployments/host/gpu.py's
EnergyMeter over NVML's energy counter) against the GPU's own power readings during a real CUDA load."""

import statistics
import subprocess
import sys
import time

import pytest

from deployments.host import gpu

pytestmark = pytest.mark.gpu
LOAD_S = 6.0
LOAD = (
    "import sys, time, torch\n"
    "a = torch.randn(8192, 8192, device='cuda:0', dtype=torch.bfloat16)\n"
    "print('ready', flush=True)\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "n = 0\n"
    "while time.monotonic() < end:\n"
    "    b = a @ a\n"
    "    n += 1\n"
    "    if n % 20 == 0: torch.cuda.synchronize()\n"
    "torch.cuda.synchronize()\n"
    "print(n, flush=True)\n"
)


def test_a_real_load_gives_plausible_joules_matching_the_gpus_power_readings(gpus):
    meter = gpu.EnergyMeter([0])
    load = subprocess.Popen([sys.executable, "-c", LOAD, str(LOAD_S)], stdout=subprocess.PIPE, text=True)
    try:
        assert load.stdout.readline().strip() == "ready"
        start = meter.read()
        powers = []
        while load.poll() is None and time.monotonic() - start < LOAD_S + 30:
            meter.read()
            watts = gpu.sample([0])[0].power_w
            if watts is not None:
                powers.append(watts)
            time.sleep(0.2)
        end = meter.read()
        matmuls = int(load.stdout.readline() or 0)
    finally:
        load.kill()
        load.wait()
    assert meter.supported, "NVML's energy counter is not readable on this GPU"
    joules = meter.joules(start, end)
    mean_w = joules / (end - start)
    sampled_w = statistics.mean(powers)
    # 2 * 8192^3 FLOP per matmul: what one joule bought, as a benchmark level reports J per output token.
    per_tflop = joules / (matmuls * 2 * 8192**3 / 1e12)
    print(f"\n{gpus[0].name}: {joules:.0f} J over {end - start:.1f} s = {mean_w:.0f} W by the energy counter, "
          f"{sampled_w:.0f} W by {len(powers)} power readings; {matmuls} matmuls, {per_tflop:.3f} J per TFLOP")
    assert 50 < mean_w < 1200, mean_w  # an H200 idles near 75-120 W and is capped at 700 W
    assert abs(mean_w - sampled_w) <= 0.25 * sampled_w, (mean_w, sampled_w)
    assert matmuls > 0 and per_tflop > 0
