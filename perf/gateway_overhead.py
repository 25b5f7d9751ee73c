"""What the node gateway costs a caller, against direct access to the same engine in the same run.

Peers, each measured right after the other at the same concurrency with the same client:
  direct:  the client -> the engine (the engine key as Bearer)
  gateway: the client -> `manage.py gateway` (a caller key among 10,000) -> the same engine
Engines: the known-schedule server (tests/schedserver.py, TTFT 50 ms, a token every 10 ms: it is never the limit)
and the real CPU vLLM serving the tiny model (unless --no-engine). The client is a bare asyncio/aiohttp
chunk reader (uvloop) streaming /v1/completions with include_usage; tokens are the engine's usage counts.

Figures (a PASS, MISS or NOT RUN line per target, then the last line holds them as name=value pairs):
  tok/s ratio gateway/direct at c=1, 64, 256, schedserver and CPU engine   [>= 0.98]
  added TTFT p50 / p99 at c=64 (gateway minus direct, schedserver)          [<= 1 ms / <= 5 ms]
  the c=64 ratio with 1 key and with 10,000 keys configured                 [no measurable change: >= -0.02]
  revocation: revoke + changes.changed() -> the first 401, worst of 5        [<= 1 s]
  gateway RSS over a soak at the zero-delay schedserver's top speed         [flat, +-10 %]

    python perf/gateway_overhead.py [--seconds 6] [--soak-seconds 60] [--full-soak] [--no-engine]
                                    [--repeats 1] [--engine-seconds 6] [--no-pin] [--no-priority]

--full-soak: the full 10-minute soak. A fresh SQLite file and an embedded Redis of its own.
--repeats N: N peer pairs per level, the order alternating; a level's ratio is the median of its pairs' ratios,
and the line shows each pair's ratio and their spread.
--pin (the default with 2 cores or more): the CPU engine, every process and thread of it, runs on the first core
alone (taskset and VLLM_CPU_OMP_THREADS_BIND) and the client, gateway and test servers on the others, as on a
GPU host, where the engine's CPU work never shares a core with the gateway. Unpinned, vLLM's CPU build takes
every core it finds, and the ratio measures the competition for them, not the gateway.
--priority (the default, root only): nice and autogroup -20 for this run's processes, so that other work on a
shared machine does not decide the figures.
"""
import argparse
import asyncio
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import psutil  # noqa: E402
from vllmbench import raise_priority  # noqa: E402

perf_counter = time.perf_counter
KEYS = 10_000
NODE = "perf-gw"
TINY_MODEL = ROOT / "var" / "tiny-model"
VLLM = ROOT / ".engine-venv" / "bin" / "vllm"


def pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


async def level(url, headers, body, concurrency, seconds):
    """Stream `body` from `concurrency` callers for `seconds`: (output tok/s, TTFTs in s, errors, requests)."""
    payload = json.dumps(body).encode()
    headers = {**headers, "Content-Type": "application/json"}
    ttfts, counts, errors = [], [0], [0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 20,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        end = perf_counter() + seconds

        async def caller():
            while perf_counter() < end:
                sent, first, tail = perf_counter(), None, b""
                async with session.post(url, data=payload, headers=headers) as reply:
                    if reply.status != 200:
                        errors[0] += 1
                        await reply.read()
                        await asyncio.sleep(0.01)
                        continue
                    async for piece in reply.content.iter_any():
                        if first is None and b"data: {" in piece:
                            first = perf_counter()
                        tail = (tail + piece)[-4096:]
                found = re.findall(rb'"completion_tokens":(\d+)', tail)
                if not found or first is None:
                    errors[0] += 1
                    continue
                counts[0] += int(found[-1])
                ttfts.append(first - sent)

        started = perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = perf_counter() - started
    return counts[0] / elapsed, ttfts, errors[0], len(ttfts)


def cpu_s(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(direct, gateway, body, concurrency, seconds, repeats=1, gateway_process=None):
    """Both peers at one concurrency, `repeats` times, the order alternating so that neither always meets an
    engine the other just warmed (a short warm-up each first): [{peer: (tok/s, ttfts, errors, requests)}], and
    with `gateway_process` under "cpu" the cores the client and the gateway kept busy during the gateway's run."""
    peers = [("direct", direct), ("gateway", gateway)]
    client = psutil.Process()
    out = []
    for repeat in range(repeats):
        pair = {}
        for name, (url, headers) in peers if repeat % 2 == 0 else peers[::-1]:
            asyncio.run(level(url, headers, body, concurrency, min(1.0, seconds)))
            before = perf_counter(), cpu_s(client), cpu_s(gateway_process) if gateway_process else 0.0
            pair[name] = asyncio.run(level(url, headers, body, concurrency, seconds))
            if name == "gateway" and gateway_process:
                wall = perf_counter() - before[0]
                pair["cpu"] = ((cpu_s(client) - before[1]) / wall, (cpu_s(gateway_process) - before[2]) / wall)
        out.append(pair)
    return out


def setup_panel(var: Path, children):
    """SQLite + embedded Redis + migrations in this process; returns the env for child processes."""
    from panelctl import launcher

    os.environ.update(PANEL_VAR_DIR=str(var), DJANGO_SETTINGS_MODULE="controlpanel.settings",
                      CHANNELS_PREFIX=f"perfgw{os.getpid()}", SECRET_KEY=secrets.token_urlsafe(50))
    os.environ.pop("DATABASE_URL", None)
    os.environ["REDIS_URL"] = launcher.start_embedded_redis(children, dict(os.environ), var)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return dict(os.environ, PYTHONUNBUFFERED="1")


def seed_keys(n: int) -> None:
    from django.contrib.auth import get_user_model

    from deployments.gateway.config import digest
    from deployments.gateway.models import CallerKey

    owner = get_user_model().objects.get(username="perf")
    CallerKey.objects.bulk_create([CallerKey(owner=owner, name=f"k{i}", prefix=f"vcp-{i:08d}",
                                             digest=digest(f"vcp-perf-{i}-{secrets.token_hex(8)}"))
                                   for i in range(n)], batch_size=2000)


def add_key(**fields) -> str:
    from django.contrib.auth import get_user_model

    from deployments.gateway.config import digest
    from deployments.gateway.models import CallerKey

    secret = "vcp-" + secrets.token_urlsafe(32)
    owner, _ = get_user_model().objects.get_or_create(username="perf")
    CallerKey.objects.create(owner=owner, name="perf", prefix=secret[:12], digest=digest(secret), **fields)
    return secret


def add_deployment(port: int, served: str, engine_key: str = "", in_flight: int = 1024):
    from deployments import sealed
    from deployments.gateway.models import Route
    from deployments.models import Deployment, ModelRepo, Node

    node, _ = Node.objects.get_or_create(name=NODE, defaults={"address": "127.0.0.1"})
    model = ModelRepo.objects.create(repo_id=f"perf/{served}-{port}")
    d = Deployment.objects.create(name=f"{served}-{port}", model=model, node=node, port=port, status="ready",
                                  engine_args={"served-model-name": served},
                                  engine_key=sealed.seal(engine_key) if engine_key else "")
    Route.objects.create(deployment=d, max_in_flight=in_flight, queue_bound=4096)
    return d


def changed():
    from deployments.gateway import changes

    changes.changed("perf")


def start_sched(children, *flags) -> str:
    from panelctl import launcher

    port = launcher.free_port()
    children.start("schedserver", [sys.executable, "tests/schedserver.py", "--port", str(port), *flags],
                   dict(os.environ), stdout=subprocess.DEVNULL)
    launcher.wait_for_port(port, timeout=30)
    return port


def start_gateway(children, env, log: Path):
    proc = children.start("gateway", [sys.executable, "manage.py", "gateway", "--node", NODE, "--host", "127.0.0.1",
                                      "--port", "0"], env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", log.read_bytes())
        if found:
            return proc, f"http://127.0.0.1:{int(found.group(1))}"
        if proc.poll() is not None:
            raise SystemExit("the gateway exited:\n" + log.read_text()[-2000:])
        time.sleep(0.1)
    raise SystemExit("the gateway did not start:\n" + log.read_text()[-2000:])


def start_engine(children, var: Path, core: int | None) -> tuple[int, str]:
    """The tiny model on the CPU vLLM; with `core`, every process and thread of it (API server, EngineCore,
    the worker's OpenMP thread) on that core alone."""
    from deployments.host import serveargv
    from panelctl import launcher

    port, key = launcher.free_port(), secrets.token_urlsafe(32)
    argv = serveargv.build_argv(str(VLLM), str(TINY_MODEL), port, "127.0.0.1", {
        "enforce-eager": True, "max-model-len": 512, "served-model-name": "tiny", "max-num-seqs": 256})
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CACHE_ROOT=str(var / "vllm-cache"), VLLM_API_KEY=key,
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    if core is not None:
        argv = ["taskset", "-c", str(core), *argv]
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    children.start("engine", argv, env, stdout=open(var / "engine.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            import urllib.request

            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return port, key
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the CPU engine did not start: " + (var / "engine.log").read_text()[-2000:])


def pooled(pairs, peer):
    """One peer's repeats together: (mean tok/s, all TTFTs, errors, requests)."""
    runs = [pair[peer] for pair in pairs]
    return (sum(r[0] for r in runs) / len(runs), [t for r in runs for t in r[1]], sum(r[2] for r in runs),
            sum(r[3] for r in runs))


def pin(pids, cpus) -> None:
    """Every thread of each process onto `cpus` (threads they start later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:  # a thread that just ended
                pass


def ratios(results, label, report, figures, levels):
    """Each level's figure is the median of its repeats' ratios (each repeat's two peers ran back to back);
    the line shows every repeat's ratio and their spread."""
    for c in levels:
        each = [pair["gateway"][0] / pair["direct"][0] if pair["direct"][0] else float("nan") for pair in results[c]]
        ratio = statistics.median(each)
        figures[f"{label}_c{c}_ratio"] = round(ratio, 3)
        (d_tps, d_ttft, d_err, d_n), (g_tps, g_ttft, g_err, g_n) = pooled(results[c], "direct"), pooled(results[c], "gateway")
        spread = f" (repeats {' '.join(f'{r:.3f}' for r in each)}, spread {max(each) - min(each):.3f})" if len(each) > 1 else ""
        if "cpu" in results[c][0]:
            spread += (f"   busy cores through the gateway: client {statistics.mean(p['cpu'][0] for p in results[c]):.2f}, "
                       f"gateway {statistics.mean(p['cpu'][1] for p in results[c]):.2f}")
        report.append(f"{label} c={c:<4} direct {d_tps:9.0f} tok/s ({d_n} req, {d_err} err)   gateway {g_tps:9.0f} "
                      f"tok/s ({g_n} req, {g_err} err)   ratio {ratio:.3f}{spread}   TTFT p50 {pct(d_ttft, 50) * 1e3:.1f} -> "
                      f"{pct(g_ttft, 50) * 1e3:.1f} ms, p99 {pct(d_ttft, 99) * 1e3:.1f} -> {pct(g_ttft, 99) * 1e3:.1f} ms")


def revocation_ms(gateway_url) -> float:
    import httpx

    from deployments.gateway.models import CallerKey

    worst = 0.0
    body = {"model": "sched", "prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=gateway_url, timeout=10) as client:
        for _ in range(5):
            secret = add_key()
            changed()
            while client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}).status_code != 200:
                time.sleep(0.01)
            from django.utils import timezone

            CallerKey.objects.filter(prefix=secret[:12]).update(revoked_at=timezone.now())
            changed()
            revoked = perf_counter()
            while client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {secret}"}).status_code == 200:
                pass
            worst = max(worst, perf_counter() - revoked)
    return worst * 1000


def soak(gateway_url, key, seconds, proc) -> dict:
    """Stream at the zero-delay server's top speed for `seconds`, sampling the gateway's RSS every second."""
    rss, stats = [], {"requests": 0}
    body = {"model": "blast", "prompt": "go", "max_tokens": 64, "stream": True}
    process = psutil.Process(proc.pid)

    async def run():
        payload = json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        end = perf_counter() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def caller():
                while perf_counter() < end:
                    async with session.post(gateway_url + "/v1/completions", data=payload, headers=headers) as r:
                        async for _ in r.content.iter_any():
                            pass
                    stats["requests"] += 1

            async def sampler():
                while perf_counter() < end:
                    rss.append(process.memory_info().rss)
                    await asyncio.sleep(1.0)

            await asyncio.gather(sampler(), *(caller() for _ in range(32)))

    asyncio.run(run())
    settled = rss[max(1, len(rss) // 10):]  # after the first tenth: connections and caches warm
    return {"requests": stats["requests"], "events": stats["requests"] * 64, "rss_start_mb": settled[0] / 2**20,
            "rss_end_mb": settled[-1] / 2**20, "rss_max_mb": max(settled) / 2**20,
            "growth": settled[-1] / settled[0] - 1}


def verdicts(figures) -> list[str]:
    """One line per target: PASS or MISS with the figure, or NOT RUN when its part was skipped."""
    out = []

    def check(name, ok, shown, target):
        out.append(f"{'PASS' if ok else 'MISS'}  {name} {shown}  [{target}]")

    for peer in ("sched", "cpu_engine"):
        found = {k: v for k, v in figures.items() if k.startswith(f"{peer}_c") and k.endswith("_ratio")}
        if not found:
            out.append(f"NOT RUN  {peer} tok/s ratios  [>= 0.98]")
        for k, v in found.items():
            check(k, v >= 0.98, f"{v:.3f}", ">= 0.98")
    if "added_ttft_p50_ms" in figures:
        check("added TTFT p50 at c=64", figures["added_ttft_p50_ms"] <= 1.0, f"{figures['added_ttft_p50_ms']:+.2f} ms",
              "<= 1 ms")
        check("added TTFT p99 at c=64", figures["added_ttft_p99_ms"] <= 5.0, f"{figures['added_ttft_p99_ms']:+.2f} ms",
              "<= 5 ms")
    if "sched_c64_ratio" in figures:
        drift = figures["sched_c64_ratio"] - figures["sched_c64_ratio_1key"]
        check(f"c=64 ratio, {KEYS} keys vs 1", drift >= -0.02, f"{drift:+.3f}", "no measurable change: >= -0.02")
    check("revocation", figures["revocation_ms"] <= 1000, f"{figures['revocation_ms']:.0f} ms", "<= 1 s")
    growth = figures["soak_rss_growth"]
    check("gateway RSS over the soak", abs(growth) <= 0.10, f"{growth * 100:+.1f} %", "+-10 %")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="each peer's time at each concurrency")
    parser.add_argument("--soak-seconds", type=float, default=60.0)
    parser.add_argument("--full-soak", action="store_true", help="the full 10-minute soak")
    parser.add_argument("--no-engine", action="store_true", help="schedserver only (no CPU vLLM)")
    parser.add_argument("--levels", default="1,64,256")
    parser.add_argument("--repeats", type=int, default=1, help="each level's peer pairs, the order alternating")
    parser.add_argument("--engine-seconds", type=float, default=6.0, help="--seconds for the CPU engine")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=len(os.sched_getaffinity(0)) >= 2,
                        help="the CPU engine on the first core, the rest on the others (default with >= 2 cores)")
    parser.add_argument("--priority", action=argparse.BooleanOptionalAction, default=True,
                        help="nice and autogroup -20 for this run's processes (root only): others' work on a "
                             "shared machine would otherwise decide the figures")
    args = parser.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    from panelctl import launcher

    load_start = os.getloadavg()[0]
    var = Path(tempfile.mkdtemp(prefix="perf-gateway-"))
    restore = raise_priority() if args.priority else (lambda: None)
    children = launcher.Children()
    report, figures = [], {}
    try:
        env = setup_panel(var, children)
        sched_port = start_sched(children, "--ttft-ms", "50", "--gap-ms", "10", "--default-max-tokens", "64")
        blast_port = start_sched(children, "--zero-delay", "--default-max-tokens", "64")
        add_deployment(sched_port, "sched")
        add_deployment(blast_port, "blast")
        key = add_key()
        proc, gateway = start_gateway(children, env, var / "gateway.log")
        if args.priority:  # each child started a session, so an autogroup, of its own
            for _, child in children.procs:
                raise_priority(child.pid)
        body = {"model": "sched", "prompt": "hello there", "max_tokens": 64, "stream": True,
                "stream_options": {"include_usage": True}}
        direct = (f"http://127.0.0.1:{sched_port}/v1/completions", {})
        through = (f"{gateway}/v1/completions", {"Authorization": f"Bearer {key}"})
        one_key = measure(direct, through, body, 64, args.seconds)[0]
        seed_keys(KEYS - 1)
        changed()
        time.sleep(3)  # the reload of 10,000 keys
        results = {c: measure(direct, through, body, c, args.seconds, args.repeats) for c in levels}
        ratios(results, "sched", report, figures, levels)
        r1 = one_key["gateway"][0] / one_key["direct"][0]
        figures["sched_c64_ratio_1key"] = round(r1, 3)
        report.append(f"c=64 with 1 key: ratio {r1:.3f}; with {KEYS} keys: {figures.get('sched_c64_ratio', float('nan')):.3f}")
        if 64 in results:
            d, g = pooled(results[64], "direct")[1], pooled(results[64], "gateway")[1]
            figures["added_ttft_p50_ms"] = round((pct(g, 50) - pct(d, 50)) * 1e3, 2)
            figures["added_ttft_p99_ms"] = round((pct(g, 99) - pct(d, 99)) * 1e3, 2)
        figures["revocation_ms"] = round(revocation_ms(gateway), 1)
        if not args.no_engine and VLLM.exists() and TINY_MODEL.exists():
            # Pinned, the engine has the first core and everything else (this client, the gateway, the test
            # servers, Redis) the others, as on a GPU host, where the engine's CPU work never shares a core.
            cpus = sorted(os.sched_getaffinity(0))
            others = [os.getpid(), *(p.pid for _, p in children.procs)]
            if args.pin:
                pin(others, cpus[1:])
            engine_port, engine_key = start_engine(children, var, cpus[0] if args.pin else None)
            if args.priority:
                raise_priority(children.procs[-1][1].pid)  # its own session: an autogroup of its own
            add_deployment(engine_port, "tiny", engine_key, in_flight=256)
            changed()
            time.sleep(1.5)
            tiny = {**body, "model": "tiny", "prompt": "The capital of France is", "ignore_eos": True}
            engine_results = {c: measure((f"http://127.0.0.1:{engine_port}/v1/completions",
                                          {"Authorization": f"Bearer {engine_key}"}),
                                         through, tiny, c, args.engine_seconds, args.repeats, psutil.Process(proc.pid))
                              for c in levels}
            ratios(engine_results, "cpu_engine", report, figures, levels)
            report.append(f"CPU engine {'on core ' + str(cpus[0]) + ', the rest on ' + ','.join(map(str, cpus[1:])) if args.pin else 'unpinned'}"
                          f"; {args.repeats} repeats of {args.engine_seconds:.0f} s per peer and level, order alternating")
            pin(others, cpus)
        soaked = soak(gateway, key, 600.0 if args.full_soak else args.soak_seconds, proc)
        figures["soak_requests"] = soaked["requests"]
        figures["soak_rss_growth"] = round(soaked["growth"], 3)
        report.append(f"soak {600 if args.full_soak else args.soak_seconds:.0f} s at the zero-delay server: "
                      f"{soaked['requests']} requests, {soaked['events']} events; gateway RSS {soaked['rss_start_mb']:.1f}"
                      f" -> {soaked['rss_end_mb']:.1f} MB (max {soaked['rss_max_mb']:.1f}), {soaked['growth'] * 100:+.1f} %")
    finally:
        children.stop()
        restore()
    print(f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores; "
          f"{KEYS} keys configured")
    for line in report + verdicts(figures):
        print(line)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
