"""The most streamed tokens/s each client can measure: the benchmark runner against `vllm bench serve`.

A zero-delay server (tests/schedserver.py --zero-delay: every chunk as fast as it can, one token
per chunk) runs pinned to one core; each client runs pinned to the other, so the client's own
per-chunk cost is what limits the figure. Each client runs a few concurrency levels with long
outputs, which client goes first alternating level by level; its best output tokens/s (output tokens over its
measured duration) counts.

    python perf/bench_ceiling.py [--levels 16,64,256] [--output-tokens 2000] [--no-vllm]

Last line: ours_tok_s=... vllm_tok_s=... ratio=...  Target: ratio >= 1.5.
"""
import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.runner import LoadSpec, Sweeper  # noqa: E402
from vllmbench import VLLM, Server, comparison_args, make_tokenizer, pin_client, run_vllm  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="16,64,256")
    parser.add_argument("--output-tokens", type=int, default=2000)
    parser.add_argument("--requests-per-user", type=int, default=4)
    comparison_args(parser)
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    use_vllm = VLLM.exists() and not args.no_vllm
    server_core, client_core, restore = pin_client(args.no_priority)
    server = Server(server_core, "--zero-delay")
    workdir = Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    best = {"ours": 0.0, "vllm": 0.0}
    try:
        tokenizer = make_tokenizer(workdir) if use_vllm else None
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="random", input_tokens=64,
                        max_tokens=args.output_tokens, ignore_eos=True, min_requests=128,
                        requests_per_user=args.requests_per_user, warmup_per_user=1, scrape_metrics=False)
        with Sweeper(spec, max(levels)) as sweeper:

            def ours(concurrency):
                level = sweeper.run_level(concurrency)
                best["ours"] = max(best["ours"], level.output_throughput)
                print(f"ours  c={concurrency:<4} {level.output_throughput:9.0f} tok/s  "
                      f"({level.output_tokens} tokens in {level.duration_s:.2f} s, failed {level.failed_requests})",
                      flush=True)

            def vllm(concurrency):
                data = run_vllm(server.base_url, client_core, tokenizer, workdir, concurrency,
                                spec.num_requests(concurrency), args.output_tokens, concurrency)
                best["vllm"] = max(best["vllm"], data["output_throughput"])
                print(f"vllm  c={concurrency:<4} {data['output_throughput']:9.0f} tok/s  "
                      f"({data['total_output_tokens']} tokens in {data['duration']:.2f} s, "
                      f"failed {data['failed']})", flush=True)

            for k, concurrency in enumerate(levels):  # which client goes first alternates level by level
                for client in ([ours, vllm] if use_vllm else [ours])[::1 if k % 2 == 0 else -1]:
                    client(concurrency)
    finally:
        server.close()
        restore()
        shutil.rmtree(workdir, ignore_errors=True)
    ratio = f"{best['ours'] / best['vllm']:.2f}" if best["vllm"] else "n/a"
    vllm = f"{best['vllm']:.0f}" if use_vllm else "n/a"
    print(f"ours_tok_s={best['ours']:.0f} vllm_tok_s={vllm} ratio={ratio}")


if __name__ == "__main__":
    main()
