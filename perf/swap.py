"""The panel's own overhead around a swap (sleep mode), beyond the engine's own sleep and wake calls.

The whole panel runs as `./panel start` runs it (tests/sleeppanel.py: the launcher, an embedded Redis, SQLite, a
node agent); a swap pair is deployed through the REST API (A serving, B started asleep on the same GPU), then A and
B are swapped back and forth. Per swap:

  total_s     the swap request sent -> the API shows the target ready (its events long poll, as panelctl waits)
  engine_s    the engine's own POST /sleep (source) + POST /wake_up (target), as the agent timed the calls
  overhead_s  total_s - engine_s: the panel's part (API, queue, agent, NVML waits, status moves, the long poll)

On a host with an NVIDIA GPU the engine is the GPU stand-in (tests/gpu/standin_vllm.py), which frees and
re-allocates real GPU memory on sleep and wake, so the agent's NVML waits are real; elsewhere the CPU fake
(tests/faults/fakevllm/vllm), which speaks the same endpoints. Target: overhead p95 <= 0.5 s.

    python perf/swap.py [--swaps 10]

Last line: name=value pairs (seconds; p50 and p95 over the swaps).
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.sleeppanel import GIB, SwapPair  # noqa: E402


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile, linear between the closest ranks (statistics' "inclusive" method)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure(swaps: int, on_gpu: bool) -> tuple[list, SwapPair]:
    base = Path(tempfile.mkdtemp(prefix="perf-swap-"))
    base.chmod(0o755)  # the engine user reads the engine double and the models inside
    pair = SwapPair(base, on_gpu)
    done = []
    try:
        pair.start()
        for i in range(swaps):
            source, target = ("a", "b") if i % 2 == 0 else ("b", "a")
            done.append(pair.swap(source, target))
            s = done[-1]
            held = ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in sorted(s.held.items()))
            print(f"swap {i + 1}: {source} -> {target} total {s.total_s:.3f} s, engine {s.engine_s:.3f} s, "
                  f"overhead {s.overhead_s:.3f} s, agent's step {s.agent_s:.3f} s" + (f"; NVML {held}" if held else ""),
                  flush=True)
    finally:
        pair.stop()
    return done, pair


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("perf/swap.py runs as root: the agent starts engines as the engine user only as root")
    on_gpu = shutil.which("nvidia-smi") is not None
    done, _ = measure(args.swaps, on_gpu)
    overhead = [s.overhead_s for s in done]
    total = [s.total_s for s in done]
    print(f"engine={'gpu-stand-in' if on_gpu else 'cpu-fake'} swaps={len(done)} "
          f"total_p50_s={statistics.median(total):.3f} total_p95_s={percentile(total, 95):.3f} "
          f"engine_p50_s={statistics.median(s.engine_s for s in done):.3f} "
          f"overhead_p50_s={statistics.median(overhead):.3f} overhead_p95_s={percentile(overhead, 95):.3f} "
          f"overhead_max_s={max(overhead):.3f} target_p95_s=0.5")


if __name__ == "__main__":
    main()
