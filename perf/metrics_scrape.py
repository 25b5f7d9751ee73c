"""Scrape time of /metrics for a large fleet: 32 nodes x 8 GPUs (each node sending a telemetry
sample every second while we measure, as agents do), 100 deployments with their timelines, model
copies, and 1,000 benchmark runs of 3 levels each.

The panel runs as in production (uvicorn serving the ASGI app, `--workers 2`), the scrapers
authenticate with METRICS_TOKEN and scrape as Prometheus does: each on its own connection, on a
fixed interval (`--interval`, far denser than Prometheus' 15 s), so a scrape finds the nodes'
samples new since the last one, as a real scrape always does. The peer is the same server's bare
/healthz asked the same way by as many clients at the same moment, for the same time: the floor that uvicorn,
Django and the network stack cost before any panel code. The server's CPU per scrape is that phase's CPU less the
/healthz requests' share, which a short phase of /healthz alone measures after it.

    python perf/metrics_scrape.py [--seconds 60] [--scrapers 2] [--interval 0.5]

The last line holds the figures as name=value pairs. Target: scrape_p99_ms <= 50, and the answer's size the
same with 10,000 runs kept as with 1,000 (it carries each deployment's latest run, not the history).
Uses DATABASE_URL when set, else a fresh SQLite file; starts its own Redis.
"""
import argparse
import os
import secrets
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from perf.api_latency import pct  # noqa: E402  (the same percentile as the API benchmark)

TOKEN = "perf-scrape-token"
NODES, GPUS, DEPLOYMENTS, RUNS, LEVELS = 32, 8, 100, 1000, (1, 8, 64)


def sample(node_index: int, t: float) -> dict:
    """One node's telemetry sample as the agent sends it (8 GPUs, one engine process each)."""
    gib = 2**30
    return {
        "t": t, "nvml_error": "",
        "gpus": [{"index": i, "uuid": f"GPU-{node_index:02d}-{i}", "memory_total": 141 * gib, "memory_used": 120 * gib,
                  "memory_free": 21 * gib, "util_gpu": 90, "util_memory": 40, "temperature_c": 60, "power_w": 650.0,
                  "power_limit_w": 700.0, "sm_clock_mhz": 1980, "pcie_gen": 5, "pcie_width": 16,
                  "ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0,
                  "processes": [{"pid": 1000 + i, "pgid": 1000, "used_memory": 119 * gib, "name": "python3"}]}
                 for i in range(GPUS)],
        "disk": {"total": 30 * 10**12, "free": 12 * 10**12, "used": 18 * 10**12},
        "host": {"ram_total": 2 * 2**40, "ram_available": 2**40, "load1": 12.0},
    }


def seed() -> list[int]:
    """The fleet, its deployments (timelines included), copies and runs; returns the node ids."""
    from django.utils import timezone

    from deployments.models import Deployment, DeploymentEvent, Gpu, ModelCopy, ModelRepo, Node

    now = timezone.now()
    nodes = Node.objects.bulk_create([Node(name=f"gpu-{i:02d}", address=f"10.0.0.{i}", agent_version="0.1.0",
                                           last_heartbeat=now, disk_total=30 * 10**12, disk_free=12 * 10**12)
                                      for i in range(NODES)])
    Gpu.objects.bulk_create([Gpu(node=n, index=i, uuid=f"GPU-{k:02d}-{i}", name="NVIDIA H200", memory_total=141 * 2**30)
                             for k, n in enumerate(nodes) for i in range(GPUS)])
    models = ModelRepo.objects.bulk_create([ModelRepo(repo_id=f"org/model-{i}", total_size=500 * 10**9) for i in range(20)])
    ModelCopy.objects.bulk_create([ModelCopy(model=m, node=n, state="ready", bytes_done=m.total_size, bytes_total=m.total_size)
                                   for m in models for n in nodes[:8]])
    statuses = ["ready"] * 60 + ["stopped"] * 25 + ["failed"] * 10 + ["loading"] * 5
    started = now - timedelta(hours=1)
    deployments = Deployment.objects.bulk_create([
        Deployment(name=f"d-{i}", model=models[i % 20], node=nodes[i % NODES], port=8000 + i, status=statuses[i],
                   started=started, ready_at=started + timedelta(seconds=300), restarts=i % 3,
                   engine_args={"tensor-parallel-size": 8}) for i in range(DEPLOYMENTS)])
    gpus = {(g.node_id, g.index): g for g in Gpu.objects.all()}
    Deployment.gpus.through.objects.bulk_create([
        Deployment.gpus.through(deployment=d, gpu=gpus[(d.node_id, i)]) for d in deployments for i in range(GPUS)])
    steps = ["queued", "model", "checks", "stop_others", "gpu_memory", "launch", "load", "smoke_test"]
    DeploymentEvent.objects.bulk_create([
        DeploymentEvent(deployment=d, step=s, started=started + timedelta(seconds=k), ended=started + timedelta(seconds=k + 1))
        for d in deployments for k, s in enumerate(steps)])
    add_runs(RUNS)
    return [n.pk for n in nodes]


def add_runs(count: int) -> None:
    """`count` more finished benchmark runs of LEVELS each, spread over the deployments."""
    from django.utils import timezone

    from benchmarks.models import BenchmarkPoint, BenchmarkRun
    from deployments.models import Deployment

    deployments = list(Deployment.objects.order_by("pk"))
    now, first = timezone.now(), BenchmarkRun.objects.count()
    runs = BenchmarkRun.objects.bulk_create([
        BenchmarkRun(name=f"run {first + i}", deployment=deployments[i % len(deployments)], status="done",
                     served_model="m", single_stream_tok_s=80.0, finished=now, params={"levels": list(LEVELS)})
        for i in range(count)], batch_size=2000)
    dist = {"mean": 50.0, "median": 48.0, "std": 5.0, "p90": 60.0, "p95": 65.0, "p99": 80.0}
    BenchmarkPoint.objects.bulk_create([
        BenchmarkPoint(run=r, concurrency=c, num_requests=4 * c, output_throughput=81.0 * c, ttft_ms=dist, tpot_ms=dist,
                       itl_ms=dist, e2e_ms=dist, ttfc_ms=dist, itl_per_token_ms=dist)
        for r in runs for c in LEVELS], batch_size=2000)


def agents(node_ids: list[int], stop: threading.Event) -> threading.Thread:
    """Every node sends a sample each second, as their agents do (each makes live figures stale)."""
    from deployments.services import nodes

    def run():
        while not stop.is_set():
            started = time.time()
            for k, node_id in enumerate(node_ids):
                nodes.node_sample_record(node_id, sample(k, time.time()), {})
            stop.wait(max(0.0, 1.0 - (time.time() - started)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure(base: str, path: str, clients: int, seconds: float, interval: float) -> tuple[list[float], int]:
    """`clients` scrapers, each on its own connection asking every `interval` seconds (staggered),
    as Prometheus does; returns latencies (s) and the answer's size."""
    import httpx

    start = time.monotonic()
    end = start + seconds
    size = 0

    def client(k):
        nonlocal size
        took = []
        next_at = start + k * interval / clients
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
            while next_at < end:
                time.sleep(max(0.0, next_at - time.monotonic()))
                started = time.perf_counter()
                response = http.get(path)
                took.append(time.perf_counter() - started)
                if response.status_code != 200:
                    raise SystemExit(f"{path}: {response.status_code} {response.text[:200]}")
                size = len(response.content)
                next_at = max(next_at + interval, time.monotonic())  # late: go on, no burst to catch up
        return took

    with ThreadPoolExecutor(clients) as pool:
        return [t for took in pool.map(client, range(clients)) for t in took], size


def profile_parts(seconds: float, interval: float) -> list[dict]:
    """Where a scrape's time goes: /metrics' parts timed in this process (the same code a web worker runs),
    one scrape every `interval` s while the agents write, as the server's scrapers found it."""
    import gc

    from controlpanel.metricsview import exposition

    paused = {"at": 0.0, "s": 0.0}

    def collector(phase, info):  # the cycle collector's passes, which land inside whichever part allocates
        if phase == "start":
            paused["at"] = time.perf_counter()
        else:
            paused["s"] += time.perf_counter() - paused["at"]

    gc.collect()
    gc.freeze()  # as a web worker does once loaded (controlpanel/asgi.py)
    gc.callbacks.append(collector)
    calls, end = [], time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            timings, started, paused["s"] = {}, time.perf_counter(), 0.0
            exposition(timings)
            timings["total"] = time.perf_counter() - started
            timings["of which cycle collection"] = paused["s"]
            calls.append(timings)
            time.sleep(interval)
    finally:
        gc.callbacks.remove(collector)
        gc.unfreeze()
    return calls


def print_profile(calls: list[dict]) -> None:
    total = sum(c["total"] for c in calls)
    print(f"where a scrape's time goes ({len(calls)} scrapes in this process; p50 / p99 ms, share of all their time):")
    for part in [k for k in calls[0] if k not in ("total", "of which cycle collection")] + ["total", "of which cycle collection"]:
        times = [c.get(part, 0.0) for c in calls]
        print(f"  {part:22s} {pct(times, 50):7.2f} / {pct(times, 99):7.2f}  {100 * sum(times) / total:5.1f} %")
    slow = sorted(calls, key=lambda c: c["total"])[-max(1, len(calls) // 20):]  # the slowest 5 %
    worst = max((k for k in slow[0] if k not in ("total", "of which cycle collection")),
                key=lambda k: sum(c.get(k, 0.0) for c in slow))
    share = sum(c.get(worst, 0.0) for c in slow) / sum(c["total"] for c in slow)
    print(f"  the slowest 5 % of scrapes: {pct([c['total'] for c in slow], 50):.1f} ms each, {100 * share:.0f} % of it in {worst}")


def server_cpu_s(pid: int) -> float:
    """CPU seconds used so far by the server's processes (the uvicorn master and its workers)."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--scrapers", type=int, default=2, help="Prometheus servers scraping (an HA pair by default)")
    parser.add_argument("--interval", type=float, default=0.5,
                        help="seconds between one scraper's scrapes (Prometheus' default is 15 s, 1 s is its usual minimum)")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    args = parser.parse_args()

    import logging

    from panelctl import launcher

    logging.getLogger("httpx").setLevel(logging.WARNING)
    var = Path(tempfile.mkdtemp(prefix="perf-metrics-"))
    children = launcher.Children()
    os.environ.update(PANEL_VAR_DIR=str(var), METRICS_TOKEN=TOKEN, DJANGO_SETTINGS_MODULE="controlpanel.settings",
                      CHANNELS_PREFIX=f"perf{os.getpid()}", SECRET_KEY=secrets.token_urlsafe(50))
    os.environ["REDIS_URL"] = launcher.start_embedded_redis(children, dict(os.environ), var)
    stop = threading.Event()
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        t0 = time.monotonic()
        node_ids = seed()
        print(f"seeded {NODES} nodes x {GPUS} GPUs, {DEPLOYMENTS} deployments, {RUNS} runs x {len(LEVELS)} levels "
              f"in {time.monotonic() - t0:.1f} s")
        port = launcher.free_port()
        web = children.start("web", [sys.executable, "-m", "uvicorn", "controlpanel.asgi:application", "--port", str(port),
                               "--workers", str(args.workers), "--log-level", "warning", "--no-access-log"], dict(os.environ))
        launcher.wait_for_port(port, timeout=60)
        base = f"http://127.0.0.1:{port}"
        agents(node_ids, stop)
        measure(base, "/metrics", 2 * args.workers, 3, 0.0)  # warm-up: imports, connections, each worker's cache
        cpu = server_cpu_s(web.pid)
        with ThreadPoolExecutor(2) as pool:  # the floor at the same moment, as many clients on the same interval
            asked = [pool.submit(measure, base, path, args.scrapers, args.seconds, args.interval)
                     for path in ("/metrics", "/healthz")]
            (scrapes, size), (floor, _) = (future.result() for future in asked)
        both_cpu = server_cpu_s(web.pid) - cpu
        # CPU per request is load-independent: /healthz's alone, then the rest of the same phase's is the scrapes'.
        cpu = server_cpu_s(web.pid)
        alone, _ = measure(base, "/healthz", args.scrapers, args.seconds / 4, args.interval)
        cpu_per_healthz = (server_cpu_s(web.pid) - cpu) / len(alone)
        cpu_per_scrape = (both_cpu - cpu_per_healthz * len(floor)) / len(scrapes)
        profile = profile_parts(args.seconds / 2, args.interval / args.scrapers)
        # /metrics carries state, not history: ten times the runs kept, the same answer's size.
        add_runs(9 * RUNS)
        _, size_10x = measure(base, "/metrics", 1, 0.1, 0.1)
    finally:
        stop.set()
        children.stop()
    print(f"{args.scrapers} scrapers every {args.interval:g} s, {args.workers} server workers, {args.seconds:.0f} s; "
          f"answer {size / 1e6:.2f} MB with {RUNS} runs kept, {size_10x / 1e6:.2f} MB with {10 * RUNS}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"/metrics: p50 {pct(scrapes, 50):.1f} ms  p99 {pct(scrapes, 99):.1f} ms  max {max(scrapes) * 1000:.1f} ms  "
          f"{len(scrapes)} scrapes")
    print(f"/healthz floor at the same moment: p50 {pct(floor, 50):.1f} ms  p99 {pct(floor, 99):.1f} ms")
    print_profile(profile)
    print(f"server CPU per request (uvicorn master and workers): "
          f"/metrics {cpu_per_scrape * 1000:.1f} ms, /healthz {cpu_per_healthz * 1000:.1f} ms")
    print(" ".join([f"scrape_p50_ms={pct(scrapes, 50):.1f}", f"scrape_p99_ms={pct(scrapes, 99):.1f}",
                    f"healthz_p99_ms={pct(floor, 99):.1f}", f"scrape_cpu_ms={cpu_per_scrape * 1000:.1f}",
                    f"healthz_cpu_ms={cpu_per_healthz * 1000:.1f}", f"load_avg={os.getloadavg()[0]:.1f}", f"scrape_bytes={size}",
                    f"scrape_bytes_{10 * RUNS}_runs={size_10x}", f"scrapes={len(scrapes)}",
                    f"nodes={NODES}", f"gpus={NODES * GPUS}", f"deployments={DEPLOYMENTS}", f"runs={RUNS}"]))


if __name__ == "__main__":
    main()
