"""What one telemetry sample costs on a real NVIDIA GPU host: `gpu.sample()` of every GPU (all fields
and processes), timed over many rounds. Needs a GPU; on a machine without one it says so and exits 2.

    python perf/gpu_sample_cost.py [--rounds 200]

Last line: sample_us_per_gpu=... sampler_cpu_pct_8gpus_1hz=... (CPU time, process_time).
Target: sample_us_per_gpu <= 1000 (a 1 Hz sampler of 8 GPUs then stays under 1 % of a core).
On an H200 (driver 580) it measured ~82 µs per GPU with processes.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployments.host import gpu  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    try:
        gpus = gpu.inventory()
    except gpu.NvmlUnavailable as exc:
        gpus, why = [], str(exc)
    else:
        why = "NVML lists none"
    if not gpus:
        print(f"no NVIDIA GPU here: {why}", file=sys.stderr)
        sys.exit(2)
    gpu.sample()  # the first call opens the session
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.rounds):
        gpu.sample()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    per_gpu_us = wall / args.rounds / len(gpus) * 1e6
    cpu_per_gpu_s = cpu / args.rounds / len(gpus)
    print(f"{len(gpus)} × {gpus[0].name}: sample() {per_gpu_us:.0f} µs per GPU wall, {cpu_per_gpu_s * 1e6:.0f} µs CPU")
    print(f"sample_us_per_gpu={per_gpu_us:.1f} cpu_us_per_gpu={cpu_per_gpu_s * 1e6:.1f} "
          f"sampler_cpu_pct_8gpus_1hz={cpu_per_gpu_s * 8 * 100:.3f} gpus={len(gpus)}")


if __name__ == "__main__":
    main()
