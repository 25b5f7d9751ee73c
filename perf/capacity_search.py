"""Goodput and the capacity search against a server whose capacity is known: tests/schedserver.py with a fixed
number of slots, each request holding one for a fixed service time (TTFT, then gaps), the rest queueing.

The server's own record is the truth: for every request, its TTFT from the moment its bytes arrived and
how long it held its slot. Its true capacity is slots ÷ the median time a slot was held (the schedule's
service time plus what the server itself adds), measured over every request it served in the run.

The search asks for "p90 TTFT <= the schedule's TTFT + MARGIN", with near-even arrivals (gamma gaps of
shape 100): below the capacity requests barely queue; above it the queue grows through the level, and
the level misses once its p90 request waited MARGIN. The script prints
- each level of the search: its rate, whether it met the SLO, the runner's count of requests meeting it
  and the server's own count of the same requests meeting it (the TTFT the server delivered), which
  must be equal (exact goodput);
- the search's answer, its rounds, the true capacity and the error against it, which must lie within
  the search's stated width, in at most 8 rounds.
Exit 1 when a count differs, the error exceeds the width or the search took more than 8 rounds.

    .venv/bin/python perf/capacity_search.py [--slots 4 --ttft-ms 20 --gap-ms 20 --tokens 5 --width 2]
"""
import argparse
import json
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.runner import LoadSpec, sweep  # noqa: E402
from benchmarks.runner import capacity, slo  # noqa: E402

MAX_ROUNDS = 8


def start_server(args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "schedserver.py"), "--port", "0", "--ttft-ms",
                             str(args.ttft_ms), "--gap-ms", str(args.gap_ms), "--slots", str(args.slots)],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return proc, proc.stdout.readline().strip().rsplit(" ", 1)[-1]


def truth(url: str) -> list[list[float]]:
    """Every request the server finished since the last call: [TTFT ms, E2E ms, slot held ms]."""
    with urllib.request.urlopen(url + "/stats?truth=1&reset=1", timeout=30) as response:
        return json.load(response)["truth"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=5, help="output tokens per request (one a chunk)")
    parser.add_argument("--margin-ms", type=float, default=100.0, help="the SLO: p90 TTFT <= ttft + this")
    parser.add_argument("--low", type=float, default=4.0)
    parser.add_argument("--high", type=float, default=100.0)
    parser.add_argument("--width", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0, help="of each level")
    args = parser.parse_args()
    service_ms = args.ttft_ms + args.gap_ms * (args.tokens - 1)
    limit = args.ttft_ms + args.margin_ms
    slos = slo.parse(f"ttft:p90:{limit:g}ms")
    proc, url = start_server(args)
    levels, held = [], []
    try:
        truth(url)
        spec = LoadSpec(base_url=url, model="sched", prompt_source="builtin", max_tokens=args.tokens, ignore_eos=False,
                        levels=(), min_requests=20, rate_duration_s=args.seconds, arrival="gamma", burstiness=100.0,
                        workers=1, scrape_metrics=False, seed=1, slos=slos,
                        warmup_per_user=0,  # the server's count of each level must be the level's requests alone
                        capacity={"low": args.low, "high": args.high, "width": args.width, "repeats": args.repeats})

        def on_level(level):
            served = truth(url)
            held.extend(h for *_, h in served)
            levels.append((level, sum(t <= limit for t, *_ in served), len(served)))

        result = sweep(spec, on_level=on_level)
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"server: {args.slots} slots, schedule {service_ms:g} ms a request ({args.slots / service_ms * 1000:.2f} req/s "
          f"by the schedule); SLO {slo.describe(slos)}; arrivals gamma shape 100, {args.seconds:g} s a level")
    print(f"{'rate':>8} {'rep':>3} {'met':>4} {'sent/s':>7} {'n':>5} {'runner good':>11} {'server good':>11} {'goodput':>8}")
    exact = True
    for level, server_good, served in levels:
        good = level.slo["good"]
        exact = exact and good == server_good and served == level.completed
        print(f"{level.rate:>8g} {level.repeat:>3} {'yes' if level.slo['met'] else 'no':>4} {level.achieved_rate:>7.2f} "
              f"{level.num_requests:>5} {good:>11} {server_good:>11} {level.slo['goodput']:>8.2f}")
    found = result.capacity
    true_capacity = args.slots / (statistics.median(held) / 1000.0)
    rounds = len(found["rounds"])
    error = (found["rate"] - true_capacity) if found["rate"] is not None else float("nan")
    print(found["text"])
    print(f"true capacity {true_capacity:.2f} req/s (slots / median slot held {statistics.median(held):.2f} ms); "
          f"found {found['rate']}; error {error:+.2f} req/s; stated width {found['width']:g}; rounds {rounds} "
          f"(bisection needs {capacity.rounds_needed(args.low, args.high, args.width)})")
    within = abs(error) <= found["width"]
    print(f"goodput_exact={exact} levels={len(levels)} rounds={rounds} capacity_found={found['rate']} "
          f"capacity_true={true_capacity:.3f} error={error:+.3f} width={found['width']:g} within_width={within}")
    return 0 if exact and within and rounds <= MAX_ROUNDS else 1


if __name__ == "__main__":
    sys.exit(main())
