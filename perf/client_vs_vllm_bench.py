"""Our load generator against `vllm bench serve` on the real CPU engine: output tok/s and median TTFT.

It starts `vllm serve` itself (.engine-venv, var/tiny-model; --max-model-len 2048
--no-enable-prefix-caching --enforce-eager --served-model-name tiny; VLLM_CPU_KVCACHE_SPACE=1 and its
OMP thread bound to the engine's core) under taskset on the first core, every process and thread of
it; the clients run on the second. Both clients get the same prompts and sampling: 64 output tokens,
ignore_eos, temperature 0, chat content as one text part (as vllm bench serve sends it), as many
warm-ups as the concurrency. Cases:

  long_c1   ~1,600-token prompts (650 words, prefix caching off): TTFT is mostly prefill; 16 requests
  long_c4   the same prompts at concurrency 4; 48 requests
  short_c1  ~20-token prompts (8 words): TTFT is small, a client's own milliseconds show; 32 requests

Clients: vllm (vllm bench serve); ours (benchmarks.runner as the panel runs it: its /metrics sampler
reads the engine and its workers report a tick every tick_s = 0.5 s); ours_noscrape (sampler off);
ours_scrape20hz (sampler and ticks every 50 ms: ten times the panel's rate, to show what the sampler
costs the engine, if anything); and, only when asked for, ours_enginecore (ours on the engine's
core, as an unpinned client on a busy host may be). Each round runs every case with every client,
the order rotating round by round, so that no client always meets an engine another one just warmed.

Per case and client it prints each round's output tok/s and median TTFT (ours as vllm bench serve
counts it: to the first chunk with a choice, vLLM's role-only chunk), the medians over rounds, each
client's round-to-round spread ((max - min) / median), and the engine's own mean TTFT and prefill
time over the client's runs from its /metrics histograms (read before and after each run, outside
it; warm-ups included). Before the rounds: the CPU time the engine's API server spends on one
GET /metrics (20 reads of the idle engine), i.e. what each of the sampler's readings takes from the
engine's core.

It raises its own and the engine's CPU priority while it runs (nice and autogroup -20, root only;
--no-priority skips this).

    python perf/client_vs_vllm_bench.py [--rounds 3] [--cases long_c1,long_c4,short_c1]
                                        [--clients vllm,ours,ours_noscrape,ours_scrape20hz,ours_enginecore]

Last line: name=value pairs: per case <case>_tok_s_ratio and <case>_ttft_ratio (ours / vllm in the
same round, the median over rounds: a pair ran minutes apart, so a slow drift of the machine cancels), and with 3
rounds or more <case>_tok_s_ratio_gm, _lo and _hi (and the same for ttft): the pairs' geometric mean and its 95 %
interval (Student's t on the log ratios, benchmarks/studystats.paired_ratio),
<case>_<variant>_tok_s_ratio and ..._ttft_ratio for the other variants of ours
(noscrape, scrape20hz, enginecore), <case>_<client>_vs_noscrape_tok_s_ratio (ours and ours_scrape20hz over
ours_noscrape in the same round, the median: what the sampler costs), <case>_<client>_tok_s_spread and
_ttft_spread, <case>_<client>_engine_ttft_ms, metrics_cpu_ms (API server CPU per /metrics read),
load1_start and load1_end. A ratio whose distance from 1 is within the clients' spreads is the
engine's (and the machine's) variance, not the client.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.runner import LoadSpec, load_jsonl, run_level  # noqa: E402
from benchmarks.studystats import paired_ratio  # noqa: E402
from deployments.host import processenv, processes, serveargv, vllm  # noqa: E402
from vllmbench import VLLM, free_port, pin_client, raise_priority, run_vllm  # noqa: E402

TINY_MODEL = ROOT / "var" / "tiny-model"
OUT_TOKENS = 64
# (name, concurrency, words a prompt, requests)
CASES = [("long_c1", 1, 650, 16), ("long_c4", 4, 650, 48), ("short_c1", 1, 8, 32)]
# Our client's variants: LoadSpec fields changed, and whether it runs on the engine's core.
OURS = {"ours": ({}, False), "ours_noscrape": ({"scrape_metrics": False}, False),
        "ours_scrape20hz": ({"tick_s": 0.05}, False), "ours_enginecore": ({}, True)}
CLIENTS = ("vllm", *OURS)
DEFAULT_CLIENTS = ("vllm", "ours", "ours_noscrape", "ours_scrape20hz")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def write_prompts(directory: Path, name: str, count: int, words: int) -> Path:
    """`count` distinct prompts of `words` words, one {"prompt": ...} a line (vllm bench serve's custom dataset)."""
    rng = random.Random(7)
    vocabulary = "the model serves a request from a user who asks about weather maps trains and music".split()
    path = directory / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(vocabulary) for _ in range(words))}) + "\n"
                            for _ in range(count)))
    return path


def start_engine(core: int, workdir: Path, priority: bool) -> tuple[processes.EngineHandle, str]:
    """`vllm serve` of the tiny model under taskset on `core`; (handle, base URL) once /health answers."""
    port = free_port()
    argv = serveargv.build_argv(str(VLLM), str(TINY_MODEL), port, "127.0.0.1",
                                {"max-model-len": 2048, "no-enable-prefix-caching": True, "enforce-eager": True,
                                 "served-model-name": "tiny"})
    env = processenv.deployment_env({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                                    "VLLM_CACHE_ROOT": str(workdir / "vllm-cache")})
    log = workdir / "engine.log"
    handle = processes.launch(processes.EngineSpec(argv=["taskset", "-c", str(core), *argv], env=env, log_path=log))
    if priority:
        raise_priority(handle.pid)  # its own session: an autogroup of its own
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not vllm.health(base_url):
        if not processes.alive(handle.pid) or time.monotonic() > deadline:
            processes.stop(handle.pgid, term_timeout_s=5, kill_timeout_s=5)
            raise SystemExit(f"the engine did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return handle, base_url


def metrics_text(base_url: str) -> str:
    with _OPENER.open(f"{base_url}/metrics", timeout=30) as response:
        return response.read().decode()


def engine_histograms(base_url: str) -> dict[str, float]:
    """Sum and count of the engine's TTFT and prefill-time histograms, over all label sets."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text(base_url)):
        if family.name in HISTOGRAMS:
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def engine_means_ms(before: dict, after: dict) -> dict[str, float]:
    """Mean TTFT and prefill time (ms) the engine itself saw between two readings."""
    means = {}
    for name, key in zip(HISTOGRAMS, ("engine_ttft_ms", "engine_prefill_ms")):
        count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
        if count:
            means[key] = (after[name + "_sum"] - before.get(name + "_sum", 0)) / count * 1000
    return means


def metrics_read_cpu_ms(base_url: str, api_server_pid: int, reads: int = 20) -> tuple[float, int]:
    """CPU ms the API server spends on one GET /metrics (idle engine), and the page's size in bytes."""
    proc = psutil.Process(api_server_pid)
    before = sum(proc.cpu_times()[:2])
    size = 0
    for _ in range(reads):
        size = len(metrics_text(base_url))
    return (sum(proc.cpu_times()[:2]) - before) / reads * 1000, size


def spread(values: list[float]) -> float:
    """(max - min) / median of a client's round figures: how far one round may stray from another."""
    return (max(values) - min(values)) / statistics.median(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(name for name, *_ in CASES))
    parser.add_argument("--clients", default=",".join(DEFAULT_CLIENTS))
    parser.add_argument("--no-priority", action="store_true", help="don't raise this run's CPU priority")
    args = parser.parse_args()
    cases = [case for case in CASES if case[0] in args.cases.split(",")]
    clients = [c for c in args.clients.split(",") if c in CLIENTS]
    if not VLLM.exists() or not (TINY_MODEL / "config.json").exists():
        raise SystemExit("needs scripts/install-engine's engine and tiny model")
    load_start = os.getloadavg()
    engine_core, client_core, restore = pin_client(args.no_priority)
    workdir = Path(tempfile.mkdtemp(prefix="client-vs-vllm-"))
    handle = None
    # rows[case][client] = [per round: {"tok_s", "ttft", "ttft_ours", "engine_ttft_ms", ...}]
    rows = {name: {client: [] for client in clients} for name, *_ in cases}
    try:
        handle, base_url = start_engine(engine_core, workdir, not args.no_priority)
        prompts = {name: write_prompts(workdir, name, requests, words) for name, _, words, requests in cases}
        # Each prompt as vllm bench serve's openai-chat backend sends it: a user message of text parts.
        entries = {name: load_jsonl("".join(
            json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": json.loads(line)["prompt"]}]}]}) + "\n"
            for line in path.read_text().splitlines())) for name, path in prompts.items()}
        warm = LoadSpec(base_url=base_url, model="tiny", prompt_source="jsonl", prompts=next(iter(entries.values())),
                        max_tokens=OUT_TOKENS, min_requests=8, scrape_metrics=False)
        run_level(warm, 4)  # the engine's first requests are slow: none of them counts
        cpu_ms, size = metrics_read_cpu_ms(base_url, handle.pid)
        print(f"engine core {engine_core}, client core {client_core}; one GET /metrics costs the API server "
              f"{cpu_ms:.2f} ms of CPU ({size} bytes); load average {load_start[0]:.2f}", flush=True)

        def measure(client, name, level, requests):
            before = engine_histograms(base_url)
            if client == "vllm":
                data = run_vllm(base_url, client_core, TINY_MODEL, workdir, level, requests, OUT_TOKENS, level,
                                model="tiny", dataset=prompts[name])
                if data["failed"] or data["total_output_tokens"] != OUT_TOKENS * requests:
                    raise SystemExit(f"vllm bench serve: {data['failed']} failed, {data['total_output_tokens']} tokens")
                row = {"tok_s": data["output_throughput"], "ttft": data["median_ttft_ms"],
                       "input_tokens": data["total_input_tokens"]}
            else:
                overrides, on_engine_core = OURS[client]
                spec = LoadSpec(base_url=base_url, model="tiny", prompt_source="jsonl", prompts=entries[name],
                                max_tokens=OUT_TOKENS, ignore_eos=True, temperature=0.0, min_requests=requests,
                                requests_per_user=requests // level, **overrides)
                os.sched_setaffinity(0, {engine_core if on_engine_core else client_core})
                try:
                    level_result = run_level(spec, level)
                finally:
                    os.sched_setaffinity(0, {client_core})
                if level_result.failed_requests or level_result.output_tokens != OUT_TOKENS * requests:
                    raise SystemExit(f"{client}: {level_result.errors or level_result.output_tokens}")
                row = {"tok_s": level_result.output_throughput, "ttft": level_result.ttft_vllm_bench_ms["median"],
                       "ttft_ours": level_result.ttft_ms["median"], "input_tokens": level_result.input_tokens,
                       "scrapes": level_result.server_metrics.get("samples", 0)}
            row.update(engine_means_ms(before, engine_histograms(base_url)))
            rows[name][client].append(row)
            print(f"  {time.monotonic() - started:6.0f} s {name:<8} {client:<15} {row['tok_s']:7.1f} tok/s  TTFT {row['ttft']:7.2f} ms  "
                  f"engine: TTFT {row.get('engine_ttft_ms', 0):7.2f} ms, prefill {row.get('engine_prefill_ms', 0):7.2f} ms"
                  + (f"  ({row['scrapes']} /metrics reads)" if row.get("scrapes") else ""), flush=True)

        started = time.monotonic()
        for round_ in range(args.rounds):
            order = clients[round_ % len(clients):] + clients[:round_ % len(clients)]
            print(f"round {round_ + 1}: {', '.join(order)}", flush=True)
            for name, level, _, requests in cases:
                for client in order:
                    measure(client, name, level, requests)
    finally:
        if handle is not None:
            processes.stop(handle.pgid, term_timeout_s=10, kill_timeout_s=5)
        restore()
        shutil.rmtree(workdir, ignore_errors=True)

    figures = {}
    for name, by_client in rows.items():
        inputs = {r["input_tokens"] for runs in by_client.values() for r in runs}
        if len(inputs) > 1:
            raise SystemExit(f"{name}: the clients sent different prompt tokens: {sorted(inputs)}")
        median = {client: {key: statistics.median(r[key] for r in runs) for key in ("tok_s", "ttft")}
                  for client, runs in by_client.items() if runs}
        for client, runs in by_client.items():
            figures[f"{name}_{client}_tok_s"] = median[client]["tok_s"]
            figures[f"{name}_{client}_ttft_ms"] = median[client]["ttft"]
            figures[f"{name}_{client}_tok_s_spread"] = spread([r["tok_s"] for r in runs])
            figures[f"{name}_{client}_ttft_spread"] = spread([r["ttft"] for r in runs])
            engine_ttfts = [r["engine_ttft_ms"] for r in runs if "engine_ttft_ms" in r]
            if engine_ttfts:
                figures[f"{name}_{client}_engine_ttft_ms"] = statistics.median(engine_ttfts)
        requests = next(r for case, _, _, r in cases if case == name)
        print(f"{name} ({next(iter(inputs)) / requests:.0f} prompt tokens a request): " + "; ".join(
            f"{client} {median[client]['tok_s']:.1f} tok/s (spread {figures[f'{name}_{client}_tok_s_spread']:.3f}), "
            f"TTFT {median[client]['ttft']:.2f} ms (spread {figures[f'{name}_{client}_ttft_spread']:.3f})"
            for client in median), flush=True)
        if "vllm" in median:  # ours over vllm bench serve in the same round: minutes apart, a slow drift cancels
            for client in (c for c in OURS if by_client.get(c)):
                label = "" if client == "ours" else client.removeprefix("ours_") + "_"
                paired = {key: [o[key] / v[key] for o, v in zip(by_client[client], by_client["vllm"])]
                          for key in ("tok_s", "ttft")}
                said = []
                for key, ratios in paired.items():
                    figures[f"{name}_{label}{key}_ratio"] = statistics.median(ratios)
                    if (found := paired_ratio(ratios)) is not None:  # the pairs' geometric mean and its 95 % interval
                        for suffix, value in zip(("gm", "lo", "hi"), found):
                            figures[f"{name}_{label}{key}_ratio_{suffix}"] = value
                        said.append(f"{key} {found[0]:.3f} [{found[1]:.3f}, {found[2]:.3f}]"
                                    + (" (1.0 outside)" if not found[1] <= 1.0 <= found[2] else ""))
                print(f"  {client} / vllm round by round: tok/s {' '.join(f'{r:.3f}' for r in paired['tok_s'])}, "
                      f"TTFT {' '.join(f'{r:.3f}' for r in paired['ttft'])}"
                      + (f"; over {len(paired['tok_s'])} pairs, 95 % interval: {', '.join(said)}" if said else ""),
                      flush=True)
        if by_client.get("ours_noscrape"):  # what the sampler costs: ours with it against ours without, same round
            for client in (c for c in ("ours", "ours_scrape20hz") if by_client.get(c)):
                ratios = [o["tok_s"] / n["tok_s"] for o, n in zip(by_client[client], by_client["ours_noscrape"])]
                figures[f"{name}_{client}_vs_noscrape_tok_s_ratio"] = statistics.median(ratios)
                print(f"  {client} / ours_noscrape round by round: tok/s {' '.join(f'{r:.3f}' for r in ratios)}",
                      flush=True)
    figures["metrics_cpu_ms"] = cpu_ms
    figures["rounds"] = args.rounds
    figures["load1_start"] = load_start[0]
    figures["load1_end"] = os.getloadavg()[0]
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
