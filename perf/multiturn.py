"""Multi-turn workloads: exact prompt tokens per turn, the prefix cache's figures, and the runner's ceiling.

1. Exactness, against the known-schedule server (in this process; its own record is the truth): every turn's
   prompt tokens as the runner says it sends them (workloads.expected_prompt_tokens) against the server's count
   of that request (usage.prompt_tokens) and against the server's log of every request it received; the
   server's prefix-cache hit rate (16-token blocks) next to what the workload could have reused.
2. Ceiling: a zero-delay server pinned to one core, the runner pinned to the other, long outputs; the best
   output tok/s of closed-loop levels against multi-turn levels at the same concurrencies (turns resend the
   history; no think time). Its peer is the closed-loop figure measured in the same run.

    python perf/multiturn.py [--levels 16,64] [--output-tokens 1000] [--turns 3]

Last line: exact=<mismatches> multiturn_tok_s=... closed_tok_s=... ratio=...  Targets: exact=0, ratio >= 0.9.
"""
import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.runner import LoadSpec, Sweeper, run_level, workloads  # noqa: E402
from tests.schedserver import SchedServer  # noqa: E402
from vllmbench import Server, cores, raise_priority  # noqa: E402


def exactness(turns: int) -> int:
    """Mismatches between what each turn sent and what the server counted (0 is the target)."""
    with SchedServer(ttft_ms=2, gap_ms=1, prefix_cache=True) as server:
        spec = LoadSpec(base_url=server.base_url, model="sched", input_tokens=50, max_tokens=16, min_requests=64,
                        warmup_per_user=0, workload={"kind": "multiturn", "turns": turns, "think_s": 0.01})
        level = run_level(spec, 16)
        log = list(server.server.prompt_log)
    total, _ = workloads.level_requests(spec, 16)
    per_request = sum(r.prompt_tokens != workloads.expected_prompt_tokens(spec, r.index) for r in level.records)
    expected = collections.Counter(workloads.expected_prompt_tokens(spec, i) for i in range(total))
    logged = sum((expected - collections.Counter(log)).values()) + sum((collections.Counter(log) - expected).values())
    cache, reuse = level.server_metrics.get("prefix_cache", {}), level.prefix_reuse
    print(f"exactness: {level.completed} requests ({total // turns} conversations of {turns} turns), "
          f"{per_request} differ from the server's usage, {logged} from its log of {len(log)} requests")
    print(f"prefix cache: server hit rate {cache.get('hit_rate', 0):.3f} ({cache.get('hits', 0):.0f} of "
          f"{cache.get('queries', 0):.0f} tokens), the workload could reuse {reuse.get('share', 0):.3f} "
          f"({reuse.get('reusable_tokens', 0)} tokens)", flush=True)
    return per_request + logged + (level.completed != total)


def ceiling(levels: list[int], output_tokens: int, turns: int) -> tuple[float, float]:
    """(best closed-loop output tok/s, best multi-turn output tok/s) against a zero-delay server."""
    server_core, client_core = cores()
    os.sched_setaffinity(0, {client_core})
    server = Server(server_core, "--zero-delay")
    best = {"closed": 0.0, "multiturn": 0.0}
    try:
        base = dict(base_url=server.base_url, model="sched", prompt_source="random", input_tokens=64,
                    max_tokens=output_tokens, min_requests=96, requests_per_user=3, warmup_per_user=1,
                    scrape_metrics=False)
        for mode, workload in (("closed", {}), ("multiturn", {"kind": "multiturn", "turns": turns, "think_s": 0})):
            spec = LoadSpec(**base, workload=workload)
            with Sweeper(spec, max(levels)) as sweeper:
                for concurrency in levels:
                    level = sweeper.run_level(concurrency)
                    best[mode] = max(best[mode], level.output_throughput)
                    print(f"{mode:<9} c={concurrency:<4} {level.output_throughput:9.0f} tok/s ({level.completed} "
                          f"requests, {level.output_tokens} tokens in {level.duration_s:.2f} s, failed "
                          f"{level.failed_requests}, prompt mean {level.prompt_tokens_mean:.0f})", flush=True)
    finally:
        server.close()
    return best["closed"], best["multiturn"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="16,64")
    parser.add_argument("--output-tokens", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--no-priority", action="store_true", help="don't raise this run's CPU priority")
    args = parser.parse_args()
    mismatches = exactness(args.turns)
    restore = (lambda: None) if args.no_priority else raise_priority()
    try:
        closed, multi = ceiling([int(c) for c in args.levels.split(",")], args.output_tokens, args.turns)
    finally:
        restore()
    print(f"exact={mismatches} multiturn_tok_s={multi:.0f} closed_tok_s={closed:.0f} ratio={multi / closed:.2f}")


if __name__ == "__main__":
    main()
