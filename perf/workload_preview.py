"""What a workload file at the panel's bounds costs to check (the web request, benchmarks/workloads.py workload_create)
and preview (the control worker's benchmarks.workload_preview task): Mooncake traces reaching MAX_TRACE_BLOCKS
blocks of prompt, spread over 100 to 60,000 requests (8 KiB to ~5 MB of file, under the 20 MB upload bound), and one request of MAX_TRACE_TOKENS; each checked
(workfiles.mooncake) and previewed (workfiles.preview).

The cost follows the blocks, not the file: 100 requests of 5M tokens are an 8 KiB file. The peer is the same run's
other shapes: seconds per million blocks should not grow with a request's length (a preview quadratic in it took
0.85 s at 1e7 tokens and 12.2 s at 4e7 before the bounds), so `spread` (the largest per-block cost over the
smallest, among shapes at the block bound) stays near 1.

    python perf/workload_preview.py [--repeats 3]

Prints one line per shape, then name=value figures: the slowest check and preview (worst_s, what one upload can
hold a web thread for) and the spread.
"""
import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))

from benchmarks import runner  # noqa: E402
from benchmarks.runner import workfiles  # noqa: E402


def trace(requests: int) -> str:
    per = min(workfiles.MAX_TRACE_TOKENS, (workfiles.MAX_TRACE_BLOCKS // requests) * workfiles.TRACE_BLOCK_TOKENS)
    return "\n".join(json.dumps({"timestamp": i * 10, "input_length": per, "output_length": 10, "hash_ids": [i]})
                     for i in range(requests))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    worst, per_block = 0.0, []
    for requests in (1, 100, 10_000, 60_000):
        text = trace(requests)
        parsed = workfiles.mooncake(text)
        blocks = sum(max(len(ids), -(-tokens // workfiles.TRACE_BLOCK_TOKENS)) for _, tokens, _, ids in parsed)

        def check_and_preview():
            spec = {"kind": "trace", "block_tokens": workfiles.TRACE_BLOCK_TOKENS, "requests": workfiles.mooncake(text)}
            workfiles.preview(runner.LoadSpec(base_url="http://preview", model="", workload=spec, input_tokens=100,
                                              max_tokens=10))

        seconds = statistics.median(timed(check_and_preview) for _ in range(args.repeats))
        print(f"{requests:>6} requests, {len(text) / 2**10:8.1f} KiB, {blocks:>9,} blocks: check+preview "
              f"{seconds:6.3f} s ({seconds / blocks * 1e6:5.2f} s per million blocks)")
        worst = max(worst, seconds)
        if blocks >= workfiles.MAX_TRACE_BLOCKS // 2:
            per_block.append(seconds / blocks)
    print(f"worst_s={worst:.3f} spread={max(per_block) / min(per_block):.2f}")


if __name__ == "__main__":
    main()
