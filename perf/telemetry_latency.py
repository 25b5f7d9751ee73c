"""Live telemetry latency: 4 simulated nodes x 8 GPUs at 1 Hz, 50 WebSocket clients, one machine.

Each simulated node is a real node agent process (deployments.agent.Agent) whose pynvml is the
tests' fake driver with 8 GPUs, so every sample goes the production way: agent -> Redis
(channels-redis) -> the ASGI web server (uvicorn, Channels consumer) -> 50 browser-like clients.
Latency is from the moment the sample is taken (its "t") to its arrival at each client.
The sampler's CPU time is measured inside the agents with time.process_time(); over the fake driver
it is the panel's own share only, hence the figures' names `fake_nvml_...`. The real driver's cost
is measured on a GPU host by perf/gpu_sample_cost.py (on an H200: ~82 µs per GPU with processes).

    python perf/telemetry_latency.py [--seconds 30] [--nodes 4] [--gpus 8] [--clients 50]

The last line holds the figures as name=value pairs. Targets: p95 <= 150 ms; fake_nvml_tick_cpu_pct <= 1 % of a core.
Needs REDIS_URL (or a local Redis on 6379).
"""
import argparse
import asyncio
import json
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


def setup_django(var_dir: str) -> None:
    os.environ["PANEL_VAR_DIR"] = var_dir
    os.environ.setdefault("CHANNELS_PREFIX", "perf-telemetry")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
    os.environ.setdefault("SECRET_KEY", secrets.token_urlsafe(50))  # a throwaway panel: any long key
    import django

    django.setup()


def run_agent(name: str, gpus: int, seconds: float, out: str) -> None:
    """One simulated node: the real Agent over a fake 8-GPU driver; writes its CPU figures."""
    from deployments.agent import Agent
    from deployments.host import gpu
    from tests.host.test_doctor import DoctorGpu, DoctorNvml
    from tests.nvmldouble import proc

    # The doctor's fake: the agent's start runs the host checks too, as on a real driver.
    fake = DoctorNvml([DoctorGpu(f"GPU-{name}-{i}", f":{0x18 + i:02x}:00.0", compute=[proc(10_000 + i, 70 * 2**30)])
                       for i in range(gpus)])
    gpu.pynvml, gpu._session = fake, None
    agent = Agent(name=name, model_store=tempfile.gettempdir(), address="127.0.0.1", version="perf",
                  sample_seconds=1.0, heartbeat_seconds=5.0)
    agent.register()
    sample_cpu, tick_cpu = [], []
    deadline = time.monotonic() + seconds
    next_at = time.monotonic()
    while time.monotonic() < deadline:
        c0 = time.process_time()
        agent.sample()
        c1 = time.process_time()
        agent.tick()  # samples again, then labels, stores and publishes
        c2 = time.process_time()
        sample_cpu.append(c1 - c0)
        tick_cpu.append(c2 - c1)
        next_at += 1.0
        time.sleep(max(0.0, next_at - time.monotonic()))
    Path(out).write_text(json.dumps({"sample_cpu": sample_cpu, "tick_cpu": tick_cpu}))


async def run_clients(url: str, cookie: str, origin: str, topics: list[str], clients: int, seconds: float, out: str):
    """`clients` WebSocket connections, each subscribed to every node; records arrival - taken."""
    from websockets.asyncio.client import connect

    latencies: list[float] = []

    async def one():
        async with connect(url, additional_headers={"Cookie": cookie, "Origin": origin}, max_size=2**22) as ws:
            await ws.send(json.dumps({"subscribe": topics}))
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                try:
                    raw = await asyncio.wait_for(ws.recv(), timeout=max(0.1, end - time.monotonic()))
                except asyncio.TimeoutError:
                    break
                arrived = time.time()
                message = json.loads(raw)
                if message.get("kind") == "sample" and not message.get("snapshot"):
                    latencies.append(arrived - message["data"]["t"])

    await asyncio.gather(*(one() for _ in range(clients)))
    Path(out).write_text(json.dumps(latencies))


def pct(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--clients-of", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--var", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.agent:
        setup_django(args.var)
        return run_agent(args.agent, args.gpus, args.seconds, args.out)
    if args.clients_of:
        spec = json.loads(args.clients_of)
        return asyncio.run(run_clients(spec["url"], spec["cookie"], spec["origin"], spec["topics"],
                                       args.clients, args.seconds, args.out))

    var = tempfile.mkdtemp(prefix="perf-telemetry-")
    setup_django(var)
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.test import Client

    from deployments.models import Node

    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_superuser("perf", "", "perf-password-1")
    web_client = Client()
    web_client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={web_client.cookies[settings.SESSION_COOKIE_NAME].value}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    port = 18000 + os.getpid() % 1000
    procs = [subprocess.Popen([sys.executable, "-m", "uvicorn", "controlpanel.asgi:application", "--port", str(port),
                               "--ws", "websockets-sansio", "--log-level", "warning", "--no-access-log"],
                              cwd=ROOT, env=env, start_new_session=True)]
    try:
        names = [f"sim-{i}" for i in range(args.nodes)]
        warmup = 5.0
        for name in names:
            procs.append(subprocess.Popen([sys.executable, __file__, "--agent", name, "--gpus", str(args.gpus),
                                           "--seconds", str(args.seconds + warmup), "--var", var, "--out", f"{var}/{name}.json"],
                                          cwd=ROOT, env=env, start_new_session=True))
        deadline = time.monotonic() + 60
        while Node.objects.filter(name__in=names).count() < len(names):
            if time.monotonic() > deadline:
                raise SystemExit("the simulated agents did not register")
            time.sleep(0.2)
        topics = [f"node:{pk}" for pk in Node.objects.filter(name__in=names).values_list("pk", flat=True)]
        spec = json.dumps({"url": f"ws://127.0.0.1:{port}/ws/live/", "cookie": cookie, "origin": f"http://127.0.0.1:{port}", "topics": topics})
        time.sleep(1.0)
        clients = subprocess.Popen([sys.executable, __file__, "--clients-of", spec, "--clients", str(args.clients),
                                    "--seconds", str(args.seconds), "--out", f"{var}/clients.json"], cwd=ROOT, env=env)
        clients.wait(args.seconds + 60)
        for p in procs[1:]:
            p.wait(args.seconds + 60)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:  # uvicorn can hang in its graceful shutdown: it was left running after the script ended
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    latencies = [x * 1000 for x in json.loads(Path(f"{var}/clients.json").read_text())]
    agents = [json.loads(Path(f"{var}/{n}.json").read_text()) for n in names]
    sample_cpu = [x for a in agents for x in a["sample_cpu"][2:]]
    tick_cpu = [x for a in agents for x in a["tick_cpu"][2:]]
    expected = args.clients * args.nodes * args.seconds
    print(f"nodes={args.nodes} gpus/node={args.gpus} clients={args.clients} seconds={args.seconds:.0f}")
    print(f"messages received: {len(latencies)} (about {expected:.0f} expected at 1 Hz)")
    print(f"latency ms: p50 {pct(latencies, 50):.1f}  p95 {pct(latencies, 95):.1f}  p99 {pct(latencies, 99):.1f}  max {max(latencies):.1f}")
    print(f"sampler CPU per 8-GPU sample, fake NVML (the panel's share, not the driver's): {statistics.mean(sample_cpu) * 1e3:.3f} ms; "
          f"whole tick (sample + store + publish): {statistics.mean(tick_cpu) * 1e3:.3f} ms")
    print(" ".join([
        f"p50_ms={pct(latencies, 50):.1f}", f"p95_ms={pct(latencies, 95):.1f}", f"p99_ms={pct(latencies, 99):.1f}",
        f"messages={len(latencies)}", f"fake_nvml_sampler_cpu_pct={statistics.mean(sample_cpu) * 100:.3f}",
        f"fake_nvml_tick_cpu_pct={statistics.mean(tick_cpu) * 100:.3f}",
    ]))


if __name__ == "__main__":
    main()
