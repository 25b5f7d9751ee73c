"""API latency under load: list endpoints with 10,000 benchmark points in the database,
50 concurrent clients (closed loop: each sends its next request when the last one answered).

The panel runs as in production (uvicorn serving the ASGI app, token authentication); the peer
is the same server's bare health check, asked by a few more clients at the same moment as the lists:
the floor that Django, uvicorn and the network stack cost before any panel code, under the same load.

    python perf/api_latency.py [--seconds 20] [--clients 50] [--workers 2] [--nodes 32]

Meanwhile a fleet's agents write as they do in production (default 32 nodes: a heartbeat each 5 s
and a telemetry sample each second per node, ~38 writes/s), so cached list answers keep going stale
and the figures include recomputing them, not only cache hits; `--nodes 0` measures the cache alone.
The last line holds the figures as name=value pairs, writes_per_s among them. Targets: p99 <= 100 ms and
<= 3x the floor's p99 (vs_floor).
Uses DATABASE_URL when set (PostgreSQL in production), else a fresh SQLite file. The clients are
aiohttp in this process (with the collector frozen, so its pauses are not counted as latency);
on a small machine they share the cores with the server, as the figures then show.
"""
import argparse
import asyncio
import contextlib
import gc
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENDPOINTS = ["/api/runs/", "/api/runs/{run}/points/", "/api/deployments/", "/api/nodes/", "/api/models/", "/api/copies/"]


def seed(points: int, nodes: int) -> dict:
    """`nodes` nodes (at least 8) of 8 GPUs, models, deployments and runs with `points` benchmark points;
    returns ids to query."""
    from django.contrib.auth import get_user_model

    from benchmarks.models import BenchmarkPoint, BenchmarkRun
    from deployments.models import Deployment, Gpu, ModelCopy, ModelRepo, Node
    from plumbing import tokens

    user = get_user_model().objects.create_superuser("perf", "", "perf-password-1")
    nodes = [Node.objects.create(name=f"gpu-{i:02d}", address=f"10.0.{i // 250}.{i % 250}") for i in range(max(8, nodes))]
    for node in nodes:
        Gpu.objects.bulk_create([Gpu(node=node, index=i, name="NVIDIA H200", memory_total=141 * 10**9) for i in range(8)])
    models = [ModelRepo.objects.create(repo_id=f"org/model-{i}", total_size=500 * 10**9, architecture="DeepseekV3ForCausalLM")
              for i in range(20)]
    ModelCopy.objects.bulk_create([ModelCopy(model=m, node=n, state="ready") for m in models for n in nodes[:4]])
    deployments = [Deployment.objects.create(name=f"d-{i}", model=models[i % 20], node=nodes[i % 8], port=8000 + i,
                                             status="ready", engine_args={"tensor-parallel-size": 8}) for i in range(50)]
    levels = [2**k for k in range(11)] + [1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576]  # 20 per run
    runs = BenchmarkRun.objects.bulk_create([
        BenchmarkRun(name=f"run {i}", deployment=deployments[i % 50], status="done", params={"levels": levels},
                     environment={"engine_args": {"tensor-parallel-size": 8}, "env": {"NCCL_PROTO": "LL"}})
        for i in range(points // len(levels))])
    dist = {"mean": 50.0, "median": 48.0, "std": 5.0, "p90": 60.0, "p95": 65.0, "p99": 80.0}
    BenchmarkPoint.objects.bulk_create([
        BenchmarkPoint(run=run, concurrency=c, num_requests=4 * c, output_throughput=81.0 * c, ttft_ms=dist, tpot_ms=dist,
                       itl_ms=dist, e2e_ms=dist, ttfc_ms=dist, itl_per_token_ms=dist)
        for run in runs for c in levels], batch_size=2000)
    return {"token": tokens.issue(user), "run": runs[len(runs) // 2].pk,
            "points": BenchmarkPoint.objects.count()}


async def load(base: str, token: str, paths: list[str], clients: int, seconds: float,
               by_path: dict | None = None, timings: list | None = None) -> list[float]:
    """Closed-loop clients on aiohttp: the client shares the cores, so it must cost little per request.
    `timings` gets each answer's Server-Timing (the server runs with SERVER_TIMING) and its time here, in ms."""
    import aiohttp

    by_path = {} if by_path is None else by_path
    gc.collect()
    gc.freeze()  # this process holds Django and the seed: keep the collector's pauses out of the timings
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(base, connector=connector, headers={"Authorization": f"Token {token}"}) as http:
        end = time.monotonic() + seconds

        async def client(k: int):
            nonlocal errors
            i = k
            while time.monotonic() < end:
                path = paths[i % len(paths)]
                i += 1
                started = time.perf_counter()
                async with http.get(path) as response:
                    await response.read()
                latencies.append(time.perf_counter() - started)
                by_path.setdefault(path, []).append(latencies[-1])
                if timings is not None and "Server-Timing" in response.headers:
                    timings.append(server_timing(response.headers["Server-Timing"], latencies[-1] * 1000))
                errors += response.status != 200

        await asyncio.gather(*(client(k) for k in range(clients)))
    if errors:
        raise SystemExit(f"{errors} requests failed")
    return latencies


def server_timing(header: str, total_ms: float) -> dict:
    """"wait;dur=0.12, app;dur=3.4, cache;desc=hit" -> {"wait": 0.12, "app": 3.4, "cache": "hit", "total": ...}."""
    found = {"total": total_ms}
    for metric in header.split(","):
        name, _, param = metric.strip().partition(";")
        key, _, value = param.partition("=")
        found[name] = float(value) if key == "dur" else value
    return found


def print_split(timings: list[dict]) -> None:
    """Where an API answer's time went, from the Server-Timing of each: answered on the event loop from the
    API cache (plumbing/fastlane.py), or in Django: waiting for a request thread, then middleware and view
    (answered from the API cache, or computed); and outside the panel's code (the event loop, uvicorn, the
    socket and this client, on the same cores)."""
    if not timings:
        return
    for t in timings:  # a lane answer has no wait or app part: its whole server part is "lane"
        t.setdefault("wait", 0.0)
        t.setdefault("app", t.get("lane", 0.0))
    stages = {"event loop, from the cache (lane)": [t["app"] for t in timings if t.get("cache") == "lane"],
              "waiting for a request thread": [t["wait"] for t in timings if t.get("cache") != "lane"],
              "middleware + view, cache hit": [t["app"] for t in timings if t.get("cache") == "hit"],
              "middleware + view, cache miss": [t["app"] for t in timings if t.get("cache") == "miss"],
              "outside (loop, uvicorn, client)": [t["total"] - t["wait"] - t["app"] for t in timings]}
    total = sum(t["total"] for t in timings)
    cached = sum(t.get("cache") in ("hit", "lane") for t in timings)
    lane = len(stages["event loop, from the cache (lane)"])
    print(f"where an API answer's time goes ({len(timings)} answers, {100 * cached / len(timings):.0f} % from the cache, "
          f"{100 * lane / len(timings):.0f} % on the event loop; p50 / p99 ms, share of all their time):")
    for name, values in stages.items():
        if values:
            print(f"  {name:40s} {pct(values, 50) / 1000:7.1f} / {pct(values, 99) / 1000:7.1f}  "
                  f"{100 * sum(values) / total:5.1f} %")
    slow = sorted(timings, key=lambda t: t["total"])[-max(1, len(timings) // 100):]  # the slowest 1 %
    parts = {"waiting for a request thread": sum(t["wait"] for t in slow),
             "middleware + view or lane": sum(t["app"] for t in slow),
             "outside": sum(t["total"] - t["wait"] - t["app"] for t in slow)}
    worst = max(parts, key=parts.get)
    print(f"  the slowest 1 %: {100 * parts[worst] / sum(t['total'] for t in slow):.0f} % of their time {worst}")


@contextlib.contextmanager
def fleet(nodes: int, heartbeat_s: float, sample_s: float, written: list):
    """A fleet's writes while the block runs, as its agents make them: each of `nodes` nodes writes a
    heartbeat (a Node row) every `heartbeat_s` and a telemetry sample (Redis history; answers that carry
    telemetry go stale) every `sample_s`. Appends the writes per second it made to `written`."""
    import threading

    from django.db import connection
    from django.utils import timezone

    from deployments import history
    from deployments.models import Node

    stop = threading.Event()
    rate = nodes / heartbeat_s + nodes / sample_s

    def write():
        ids = list(Node.objects.values_list("pk", flat=True)[:nodes])
        beats = samples = 0
        started = time.monotonic()
        while not stop.wait(max(0.0, started + (beats + samples + 1) / rate - time.monotonic())):
            # Heartbeats and samples interleaved at their own shares of the rate.
            if beats * heartbeat_s < samples * sample_s:
                Node.objects.filter(pk=ids[beats % len(ids)]).update(last_heartbeat=timezone.now())
                beats += 1
            else:
                history.push(ids[samples % len(ids)], {"t": time.time(), "gpus": [], "disk": {"free": 10**12}, "host": SAMPLE_HOST}, sample_s)
                samples += 1
        written.append((beats + samples) / (time.monotonic() - started))
        connection.close()

    thread = threading.Thread(target=write, daemon=True)
    if rate > 0:
        thread.start()
    try:
        yield rate
    finally:
        stop.set()
        if rate > 0:
            thread.join()


SAMPLE_HOST = {"ram_available": 448 * 10**9, "load1": 3.2}


def pct(values, p):
    """The p-th percentile of `values` (seconds) in ms; nan when there are none (a run too short to measure)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] * 1000


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--floor-clients", type=int, default=5,
                        help="closed-loop clients on /healthz during the load: the floor measured at the same moment")
    parser.add_argument("--points", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=32,
                        help="agents writing heartbeats and telemetry during the load (each write makes cached answers stale)")
    parser.add_argument("--heartbeat-seconds", type=float, default=5.0, help="as the agent's default")
    parser.add_argument("--sample-seconds", type=float, default=1.0, help="as the agent's default")
    args = parser.parse_args()

    var = tempfile.mkdtemp(prefix="perf-api-")
    os.environ["PANEL_VAR_DIR"] = var
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))  # a throwaway panel: any long key
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
    os.environ["SERVER_TIMING"] = "1"  # each answer says where its time went (print_split)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    t0 = time.monotonic()
    ids = seed(args.points, args.nodes)
    print(f"seeded {ids['points']} benchmark points in {time.monotonic() - t0:.1f} s")
    port = 19000 + os.getpid() % 1000
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "controlpanel.asgi:application", "--port", str(port),
                               "--workers", str(args.workers), "--log-level", "warning", "--no-access-log"],
                              cwd=ROOT, env=dict(os.environ), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.3)
        paths = [p.format(run=ids["run"]) for p in ENDPOINTS]
        asyncio.run(load(base, ids["token"], paths, args.clients, 3))  # warm-up
        by_path = {}
        written = []
        with fleet(args.nodes, args.heartbeat_seconds, args.sample_seconds, written):
            timings = []

            async def both():  # the floor at the same moment, from a few clients of its own
                return await asyncio.gather(load(base, ids["token"], paths, args.clients, args.seconds, by_path, timings),
                                            load(base, ids["token"], ["/healthz"], args.floor_clients, args.seconds))

            api, floor = asyncio.run(both())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    rps = len(api) / args.seconds
    writes_per_s = written[0] if written else 0.0
    print(f"{args.clients} clients, {args.workers} server workers, {args.seconds:.0f} s; endpoints: {', '.join(ENDPOINTS)}")
    print(f"meanwhile a fleet of {args.nodes} nodes wrote {writes_per_s:.1f} times a second (a heartbeat each "
          f"{args.heartbeat_seconds:g} s, a telemetry sample each {args.sample_seconds:g} s per node)")
    for path, values in by_path.items():
        print(f"  {path:<28} p50 {pct(values, 50):6.1f} ms  p99 {pct(values, 99):6.1f} ms  {len(values) / args.seconds:5.0f} req/s")
    print(f"API lists: p50 {pct(api, 50):.1f} ms  p99 {pct(api, 99):.1f} ms  {rps:.0f} req/s  (mean {statistics.mean(api) * 1000:.1f} ms)")
    print(f"/healthz floor at the same moment ({args.floor_clients} clients more): p50 {pct(floor, 50):.1f} ms  "
          f"p99 {pct(floor, 99):.1f} ms; lists' p99 {pct(api, 99) / pct(floor, 99):.2f}x the floor's")
    print_split(timings)
    print(" ".join([f"p50_ms={pct(api, 50):.1f}", f"p99_ms={pct(api, 99):.1f}", f"rps={rps:.0f}",
                    f"floor_p99_ms={pct(floor, 99):.1f}", f"vs_floor={pct(api, 99) / pct(floor, 99):.2f}",
                    f"points={ids['points']}", f"nodes={args.nodes}", f"writes_per_s={writes_per_s:.1f}"]))


if __name__ == "__main__":
    main()
