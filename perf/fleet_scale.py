"""Fleet scale: 128 simulated nodes x 8 GPUs sampling at 1 Hz (heartbeat each 5 s, some serving a
deployment, some downloading), 50 browsers on the fleet, node and deployment pages, and API
clients reading the lists, all at once for 60 s, against the panel as in production (uvicorn with
two worker processes behind one Redis and one database).

The fleet is tests/fleetsim.py: real node agents (deployments.agent.Agent, every tick unchanged)
with made-up host readings, many per process (--nodes / --procs: 32 with the defaults). Figures:
- `p95_ms`: from the moment a sample is taken to its arrival at a browser that shows it (every
  fleet-page browser shows every node; a node page its node), over every such arrival;
- `lost_pct`: samples a browser should have shown and never got, until the run's end (a browser
  whose socket closed mid-run lost what was published after; `closed` counts such sockets);
- `api_p99_ms`: list endpoints under the fleet's own writes (a closed loop of `--api-clients`);
- `healthz_p99_ms`: the same server's bare /healthz asked at the same time by as many clients:
  the floor that uvicorn, Django and this machine's load cost before any panel code.
The machine's load average before the run (other work on it) is printed beside them.

    python perf/fleet_scale.py [--nodes 128] [--gpus 8] [--browsers 50] [--seconds 60] [--procs 4]

Targets: p95_ms <= 100, lost_pct = 0, api_p99_ms <= 100. Uses DATABASE_URL when set (an empty
PostgreSQL database: the fleet's processes write at once), else a fresh SQLite file.
"""
import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from perf.api_latency import ENDPOINTS, load, pct, print_split  # noqa: E402
from perf.metrics_scrape import server_cpu_s as cpu_s  # noqa: E402

WARMUP_S = 4.0  # at each end of the run, before and after the API window


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--browsers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--procs", type=int, default=4, help="processes simulating the fleet's agents")
    parser.add_argument("--engines", type=int, default=16, help="nodes serving a ready deployment")
    parser.add_argument("--downloads", type=int, default=4, help="nodes downloading a model")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--api-clients", type=int, default=4, help="closed-loop clients on the lists (as many on /healthz)")
    parser.add_argument("--per-node-fleet", action="store_true",
                        help="fleet pages subscribe to each node's topic, as before the fleet feed (for comparison)")
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                        help="time each stage of the fleet feed and the API answers (LIVE_TRACE, SERVER_TIMING: a few timestamps "
                             "added to each message and answer)")
    parser.add_argument("--browsers-of", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.seconds <= 2 * WARMUP_S:
        parser.error(f"--seconds must be over {2 * WARMUP_S:g}: the API is measured between a warm-up at each end")

    if args.browsers_of:
        from tests import fleetsim

        spec = json.loads(args.browsers_of)
        seen = asyncio.run(fleetsim.browse(spec["url"], spec["cookie"], spec["origin"], spec["plan"], args.seconds))
        Path(args.out).write_text(json.dumps(seen))
        return

    from panelctl import launcher

    load_before = os.getloadavg()[0]
    var = Path(tempfile.mkdtemp(prefix="perf-fleet-"))
    children = launcher.Children()
    os.environ.update(PANEL_VAR_DIR=str(var), DJANGO_SETTINGS_MODULE="controlpanel.settings",
                      CHANNELS_PREFIX=f"perffleet{os.getpid()}", SECRET_KEY=secrets.token_urlsafe(50), PYTHONUNBUFFERED="1")
    if args.trace:
        os.environ.update(LIVE_TRACE="1", SERVER_TIMING="1")
    os.environ["REDIS_URL"] = launcher.start_embedded_redis(children, dict(os.environ), var)
    sims = []
    try:
        import django

        django.setup()
        from django.conf import settings
        from django.contrib.auth import get_user_model
        from django.core.management import call_command
        from django.test import Client

        from plumbing.live import drops
        from perf.api_latency import seed

        call_command("migrate", verbosity=0)
        ids = seed(2000, 0)  # 8 other nodes, 50 deployments, 100 runs x 20 levels: what the lists show
        web_client = Client()
        web_client.force_login(get_user_model().objects.get(username="perf"))
        cookie = f"{settings.SESSION_COOKIE_NAME}={web_client.cookies[settings.SESSION_COOKIE_NAME].value}"
        port = launcher.free_port()
        web = children.start("web", [sys.executable, "-m", "uvicorn", "controlpanel.asgi:application", "--port", str(port),
                                     "--workers", str(args.workers), "--ws", "websockets-sansio", "--log-level", "warning",
                                     "--no-access-log"], dict(os.environ))
        launcher.wait_for_port(port, timeout=60)

        names = [f"sim-{i:03d}" for i in range(args.nodes)]
        chunks = [names[k::args.procs] for k in range(args.procs)]
        go = var / "go"
        engines = [args.engines // args.procs + (k < args.engines % args.procs) for k in range(args.procs)]
        downloads = [args.downloads // args.procs + (k < args.downloads % args.procs) for k in range(args.procs)]
        warmup = WARMUP_S
        for k, chunk in enumerate(chunks):
            sims.append(subprocess.Popen(
                [sys.executable, "-m", "tests.fleetsim", "--names", ",".join(chunk), "--gpus", str(args.gpus),
                 "--seconds", str(args.seconds + warmup), "--engines", str(engines[k]), "--downloads", str(downloads[k]),
                 "--ready-file", str(var / f"ready-{k}.json"), "--go-file", str(go), "--out", str(var / f"sim-{k}.json")],
                cwd=ROOT, env=dict(os.environ), start_new_session=True))
        deadline = time.monotonic() + 180
        while not all((var / f"ready-{k}.json").exists() for k in range(args.procs)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in sims):
                raise SystemExit("the simulated fleet did not start")
            time.sleep(0.2)
        ready = [json.loads((var / f"ready-{k}.json").read_text()) for k in range(args.procs)]
        node_ids = [n for r in ready for n in r["nodes"]]
        deployment_ids = [d for r in ready for d in r["deployments"]]
        from tests import fleetsim

        plan = fleetsim.pages(node_ids, deployment_ids, args.browsers, per_node_fleet=args.per_node_fleet)
        spec = json.dumps({"url": f"ws://127.0.0.1:{port}/ws/live/", "cookie": cookie, "origin": f"http://127.0.0.1:{port}",
                           "plan": plan})
        go.write_text(str(time.time()))
        browsers = subprocess.Popen([sys.executable, __file__, "--browsers-of", spec, "--seconds", str(args.seconds),
                                     "--out", str(var / "browsers.json")], cwd=ROOT, env=dict(os.environ))
        time.sleep(warmup)
        dropped_before = drops.dropped()
        web_cpu = cpu_s(web.pid)
        base = f"http://127.0.0.1:{port}"
        paths = [p.format(run=ids["run"]) for p in ENDPOINTS]
        window = args.seconds - 2 * warmup

        timings, by_path = [], {}

        async def both():
            return await asyncio.gather(load(base, ids["token"], paths, args.api_clients, window, by_path, timings),
                                        load(base, ids["token"], ["/healthz"], args.api_clients, window))

        api, floor = asyncio.run(both())
        web_cpu = cpu_s(web.pid) - web_cpu
        browsers.wait(args.seconds + 120)
        for p in sims:
            p.wait(args.seconds + 120)
        dropped = drops.dropped() - dropped_before
    finally:
        for p in sims:
            if p.poll() is None:
                p.kill()
        children.stop()

    outs = [json.loads((var / f"sim-{k}.json").read_text()) for k in range(args.procs)]
    published = {int(node): ts for out in outs for node, ts in out["published"].items()}
    seen = json.loads((var / "browsers.json").read_text())
    # Every browser's window ends at the run's end (the first browser's `seconds` after it subscribed).
    result = fleetsim.account(published, seen, end=min(b["opened"] for b in seen) + args.seconds)
    latencies = result["latencies"]  # seconds, as pct() takes them
    lost_pct = 100 * result["lost"] / max(1, result["expected"])
    lag = [x for out in outs for x in out["lag"]]
    sim_cpu = sum(out["cpu_s"] for out in outs)
    by_page = {}
    for browser in seen:
        kind = "fleet" if len(browser["topics"]) > 1 else browser["topics"][0].split(":")[0]
        by_page.setdefault(kind, []).append(browser["messages"] / args.seconds)
    samples = sum(len(ts) for ts in published.values())
    sim_seconds = max(out["seconds"] for out in outs)
    print(f"{args.nodes} nodes x {args.gpus} GPUs in {args.procs} processes, {args.browsers} browsers "
          f"({', '.join(f'{len(v)} on {k} pages' for k, v in by_page.items())}), {args.seconds:.0f} s, "
          f"{args.workers} web workers; load average {load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after, "
          f"{os.cpu_count()} cores")
    print(f"fleet: {samples / sim_seconds:.0f} samples/s published, tick lag p50 {pct(lag, 50):.1f} ms "
          f"p99 {pct(lag, 99):.1f} ms, agents' CPU {100 * sim_cpu / sim_seconds:.0f} % of a core")
    print("messages per browser per second: " + ", ".join(f"{k} {statistics.mean(v):.1f}" for k, v in by_page.items()))
    print(f"sample -> browser: {len(latencies)} arrivals, p50 {pct(latencies, 50):.1f} ms "
          f"p95 {pct(latencies, 95):.1f} ms p99 {pct(latencies, 99):.1f} ms; "
          f"lost {result['lost']} of {result['expected']} expected; sockets closed early: {result['closed']}; "
          f"dropped by the channel layer: {dropped}")
    print_stages(seen)
    print(f"API lists ({args.api_clients} clients): p50 {pct(api, 50):.1f} ms p99 {pct(api, 99):.1f} ms "
          f"{len(api) / window:.0f} req/s; /healthz floor: p50 {pct(floor, 50):.1f} ms p99 {pct(floor, 99):.1f} ms; "
          f"web CPU {100 * web_cpu / window:.0f} % of a core")
    print("  by list: " + ", ".join(f"{path} p99 {pct(values, 99):.0f} ms" for path, values in sorted(by_path.items())))
    print_split(timings)
    print(" ".join([f"p95_ms={pct(latencies, 95):.1f}", f"lost_pct={lost_pct:.3f}",
                    f"api_p99_ms={pct(api, 99):.1f}", f"healthz_p99_ms={pct(floor, 99):.1f}",
                    f"p50_ms={pct(latencies, 50):.1f}", f"p99_ms={pct(latencies, 99):.1f}",
                    f"dropped={dropped}", f"closed={result['closed']}", f"arrivals={len(latencies)}", f"api_rps={len(api) / window:.0f}",
                    f"load_avg_before={load_before:.1f}", f"nodes={args.nodes}", f"gpus={args.nodes * args.gpus}",
                    f"browsers={args.browsers}"]))


STAGES = ("agent: sample taken -> published to Redis", "Redis -> the web process heard it",
          "the feed's tick: heard -> flushed to the sockets", "socket: flushed -> the browser read it")


def print_stages(seen: list[dict]) -> None:
    """Where a fleet-page arrival's time went (LIVE_TRACE): each stage's p50 and p95, and its share of the mean."""
    traced = [s for browser in seen for s in browser["samples"] if len(s) == 6]
    if not traced:
        return
    parts = [[(s[3] - s[1]), (s[4] - s[3]), (s[5] - s[4]), (s[2] - s[5])] for s in traced]
    total = sum(sum(p) for p in parts)
    print(f"stages of {len(traced)} fleet-page arrivals (p50 / p95 ms, share of the mean):")
    for k, name in enumerate(STAGES):
        stage = [p[k] for p in parts]
        print(f"  {name:52s} {pct(stage, 50):7.1f} / {pct(stage, 95):7.1f}  {100 * sum(stage) / total:5.1f} %")


if __name__ == "__main__":
    main()
