"""How close the benchmark runner's TTFT and ITL come to the truth, next to `vllm bench serve`.

The server (tests/schedserver.py) runs pinned to one core with a known schedule: first token
50 ms after the request arrived, then one token per chunk every 10 ms; the client under test
runs pinned to the other core. Levels: concurrency 1, 64, 256 and 1024.

Truth is what the server actually did, read back from its /stats after each run: per request the
first token's write time minus the request's arrival, and every gap between a stream's writes.
(On a busy 2-core machine the server cannot always keep its schedule at 1024 streams, so the
schedule itself would be the wrong yardstick.) To the TTFT truth we add the loopback overhead a
client cannot avoid, measured once with a blocking raw socket at concurrency 1: the median of
its TTFT minus the server's. Error = |client median - truth median| / truth median. Each client runs every level --rounds
times (default 3), the two clients alternating which goes first in each round. Per client and level
it prints the best, the median and the worst round: the best is the target (on a shared machine a
round can lose its core to someone else's work), the median and the worst show how much that happens.

The server sends the role chunk together with the first token, as vLLM does: vllm bench serve
0.32 counts any chunk with choices as the first token, ours skips role-only chunks.

It raises its own CPU priority while it runs (nice and autogroup -20, root only, restored at
the end; --no-priority skips this): other work on a shared machine would otherwise decide the result.

    python perf/bench_fidelity.py [--levels 1,64,256,1024] [--rounds 3] [--no-vllm]

Last line: name=value pairs with ours_max_err_pct=... vllm_max_err_pct=... (best rounds), and
ours_median_round_max_err_pct, ours_worst_round_max_err_pct (and vllm_...). Target: ours_max_err_pct <= 3 %.
"""
import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.runner import LoadSpec, Sweeper  # noqa: E402
from vllmbench import VLLM, Server, comparison_args, make_tokenizer, pin_client, run_vllm  # noqa: E402

def loopback_overhead_ms(server: Server, count: int = 20) -> float:
    """Median TTFT of a blocking raw-socket client at concurrency 1, minus the server's own TTFT."""
    body = json.dumps({"model": "sched", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       "stream": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    server.stats(reset=True)
    ttfts = []
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            received = b""
            start = time.perf_counter()
            sock.sendall(request)
            while b'"content":"w' not in received:
                received += sock.recv(65536)
            ttfts.append(time.perf_counter() - start)
            while not received.endswith(b"0\r\n\r\n"):
                received += sock.recv(65536)
    return statistics.median(ttfts) * 1000 - server.stats()["ttft_median_ms"]


def error_pct(measured: float, truth: float) -> float:
    return abs(measured - truth) / truth * 100 if truth else float("inf")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,64,256,1024")
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--requests-per-user", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="runs per level and client (best, median, worst shown)")
    comparison_args(parser)
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    use_vllm = VLLM.exists() and not args.no_vllm
    server_core, client_core, restore = pin_client(args.no_priority)
    server = Server(server_core, "--ttft-ms", "50", "--gap-ms", "10", "--tokens-per-chunk", "1",
                    "--role-with-first-token")
    workdir = Path(tempfile.mkdtemp(prefix="bench-fidelity-"))
    rows, errors, spread = [], {"ours": [], "vllm": []}, {}
    try:
        overhead = loopback_overhead_ms(server)
        print(f"server core {server_core}, client core {client_core}; loopback overhead {overhead:.3f} ms", flush=True)
        tokenizer = make_tokenizer(workdir) if use_vllm else None
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="random", input_tokens=64,
                        max_tokens=args.output_tokens, ignore_eos=True, min_requests=args.min_requests,
                        requests_per_user=args.requests_per_user, scrape_metrics=False)
        with Sweeper(spec, max(levels)) as sweeper:
            for concurrency in levels:
                rounds = {"ours": [], "vllm": []}

                def ours():
                    server.stats(reset=True)
                    level = sweeper.run_level(concurrency)
                    rounds["ours"].append(("ours", concurrency, level.ttft_ms["median"], level.itl_ms["median"],
                                           server.stats(), level.output_throughput, level.failed_requests))

                def theirs():
                    server.stats(reset=True)
                    data = run_vllm(server.base_url, client_core, tokenizer, workdir, concurrency,
                                    spec.num_requests(concurrency), args.output_tokens, spec.num_warmup(concurrency))
                    rounds["vllm"].append(("vllm", concurrency, data["median_ttft_ms"], data["median_itl_ms"],
                                           server.stats(), data["output_throughput"], data["failed"]))

                clients = [ours, theirs] if use_vllm else [ours]
                for round_ in range(args.rounds):
                    for run in (clients if round_ % 2 == 0 else clients[::-1]):  # alternating who goes first
                        run()
                for client in ("ours", "vllm"):
                    if rounds[client]:
                        ranked = sorted(rounds[client], key=lambda row: _worst_error(row, overhead))
                        rows.append(ranked[0])
                        print(_row(rows[-1], overhead, errors), flush=True)
                        for label, row in (("median", ranked[(len(ranked) - 1) // 2]), ("worst", ranked[-1])):
                            spread.setdefault(f"{client}_{label}_round", []).append(_worst_error(row, overhead))
                            print(f"      {label} round: " + _row(row, overhead, {}), flush=True)
    finally:
        server.close()
        restore()
        shutil.rmtree(workdir, ignore_errors=True)
    figures = {"ours_max_err_pct": max(errors["ours"])}
    figures["vllm_max_err_pct"] = max(errors["vllm"]) if errors["vllm"] else "n/a"
    for client, concurrency, *_ in rows:
        figures[f"{client}_ttft_err_c{concurrency}"] = errors[client + "_ttft"][concurrency]
        figures[f"{client}_itl_err_c{concurrency}"] = errors[client + "_itl"][concurrency]
    for name, worst_errors in spread.items():
        figures[f"{name}_max_err_pct"] = max(worst_errors)
    figures["rounds"] = args.rounds
    figures["loopback_ms"] = overhead
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))


def _worst_error(row, overhead) -> float:
    _, _, ttft, itl, truth, _, _ = row
    return max(error_pct(ttft, truth["ttft_median_ms"] + overhead), error_pct(itl, truth["itl_median_ms"]))


def _row(row, overhead, errors) -> str:
    client, concurrency, ttft, itl, truth, tok_s, failed = row
    true_ttft, true_itl = truth["ttft_median_ms"] + overhead, truth["itl_median_ms"]
    ttft_err, itl_err = error_pct(ttft, true_ttft), error_pct(itl, true_itl)
    errors.setdefault(client, []).extend([ttft_err, itl_err])
    errors.setdefault(client + "_ttft", {})[concurrency] = ttft_err
    errors.setdefault(client + "_itl", {})[concurrency] = itl_err
    return (f"{client:5} c={concurrency:<5} TTFT {ttft:8.2f} ms (truth {true_ttft:7.2f}, err {ttft_err:6.2f} %)  "
            f"ITL {itl:7.3f} ms (truth {true_itl:6.3f}, err {itl_err:6.2f} %)  {tok_s:9.0f} tok/s  "
            f"failed {failed}  server late p50/p99 {truth['late_p50_us']:.0f}/{truth['late_p99_us']:.0f} µs")


if __name__ == "__main__":
    main()
