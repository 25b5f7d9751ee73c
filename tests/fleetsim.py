"""A fleet's load, cheap enough to simulate 128 nodes x 8 GPUs on a laptop: many node agents in a
few processes, and browsers watching the fleet, node and deployment pages.

Each simulated node is the real `deployments.agent.Agent`, ticked by one scheduler thread per
process with the nodes' ticks spread over the second as independent hosts' are. `tick()` runs
unchanged: heartbeat, engine refresh, foreign-holder check, crash watch and engine figures, minute
rows, sample recorded and published. Only what an agent reads from its host is made up: the
sample (synthetic figures instead of NVML, /proc and statvfs, ~20 µs instead of a real
sampler's milliseconds), a fake NVML driver without processes for the holder check, and the
engines' side of the crash watch (`engine_running`, /health, /metrics readings), so that some
nodes serve a deployment whose figures reach its page. A few nodes also download a model: their
progress goes through `modelcopies.model_copy_progress`, as a real download's does.

Browsers (`browse()`) are WebSocket clients speaking the pages' protocol (static/panel/live.js):
a fleet page subscribes to "fleet", a node page to its node, a deployment page to its deployment;
each records when every node sample reached it.

    python -m tests.fleetsim --names sim-000,sim-001 --seconds 60 --out published.json   # one agent process
"""
import argparse
import asyncio
import heapq
import json
import os
import random
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

GIB = 2**30
MEMORY_TOTAL = 141 * GIB


def synthetic_sample(seed: int, gpus: int, t: float) -> dict:
    """A sample shaped like Agent.sample()'s, with figures that move a little every second."""
    wobble = int(t) % 60
    return {
        "t": t, "nvml_error": "",
        "gpus": [{"index": i, "uuid": f"GPU-{seed:04d}-{i}", "name": "NVIDIA H200", "memory_total": MEMORY_TOTAL,
                  "memory_used": (100 + (seed + i + wobble) % 40) * GIB, "memory_free": MEMORY_TOTAL - 100 * GIB,
                  "util_gpu": (seed + i + wobble) % 100, "util_memory": 40, "temperature_c": 55 + i, "power_w": 600.0,
                  "power_limit_w": 700.0, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "pcie_gen": 5, "pcie_width": 16,
                  "pcie_tx_kbps": 1000, "pcie_rx_kbps": 1000, "ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0,
                  "processes": []}
                 for i in range(gpus)],
        "disk": {"total": 30 * 10**12, "free": 12 * 10**12 - wobble, "used": 18 * 10**12 + wobble},
        "host": {"ram_total": 2 * 2**40, "ram_available": 2**40, "load1": 12.0, "cpu_count": 224, "cpu_percent": 30.0,
                 "net_rx_bps": 1e8, "net_tx_bps": 1e8},
    }


def _agent_class():
    from deployments.agent import Agent
    from deployments.host import downloads
    from deployments import modelcopies

    class SimAgent(Agent):
        """The real agent with made-up host readings (see the module's docstring)."""

        def __init__(self, seed: int, gpus: int, **kwargs):
            super().__init__(**kwargs)
            self.seed, self.gpus = seed, gpus
            self.copy = None  # a ModelCopy this node "downloads", 1 GB a second
            self.published: list[float] = []

        def sample(self) -> dict:
            return synthetic_sample(self.seed, self.gpus, time.time())

        def _report_engine(self) -> None:
            pass  # `vllm serve --help=all` once per simulated node would cost more than the fleet

        def tick(self, now=None):
            sample = super().tick(now)
            self.published.append(sample["t"])
            if self.copy is not None:
                done = min(self.copy.bytes_total, (len(self.published) % 400) * 10**9)
                modelcopies.model_copy_progress(self.copy, downloads.Progress(
                    bytes_done=done, bytes_total=self.copy.bytes_total, files={"model.safetensors": (done, self.copy.bytes_total)},
                    rate_bps=1e9, seconds_left=(self.copy.bytes_total - done) / 1e9, current_file="model.safetensors"))
            return sample

    return SimAgent


def host_boundaries(gpus: int) -> ExitStack:
    """Replace what an agent reads from its host and its engines, for this process."""
    from deployments.host import gpu, slo, vllm
    from deployments.node import watch
    from tests.nvmldouble import FakeGpu, FakeNvml

    stack = ExitStack()
    stack.enter_context(mock.patch.object(gpu, "pynvml", FakeNvml([FakeGpu(f"GPU-sim-{i}") for i in range(gpus)])))
    stack.enter_context(mock.patch.object(gpu, "_session", None))
    stack.enter_context(mock.patch.object(watch, "engine_running", return_value=True))
    stack.enter_context(mock.patch.object(watch, "record_shm"))
    stack.enter_context(mock.patch.object(vllm, "health", return_value=True))
    tokens = {"n": 0.0}

    def read_engine(url, timeout=2.0):  # a busy engine: ~80 tok/s per request, 4 running
        tokens["n"] += 160.0
        return ({"generation_tokens_total": tokens["n"], "num_requests_running": 4.0, "num_requests_waiting": 0.0,
                 "kv_cache_usage_perc": 0.3}, slo.Counters())

    stack.enter_context(mock.patch.object(vllm, "read_engine", side_effect=read_engine))
    return stack


class Fleet:
    """`names` simulated nodes of `gpus` GPUs in this process; `engines` of them serve a ready
    deployment and `downloads` of them download a model."""

    def __init__(self, names: list[str], gpus: int = 8, sample_seconds: float = 1.0, heartbeat_seconds: float = 5.0,
                 engines: int = 0, downloads: int = 0):
        self.boundaries = host_boundaries(gpus)
        SimAgent = _agent_class()
        store = tempfile.gettempdir()
        self.agents = [SimAgent(seed=_seed(name), gpus=gpus, name=name, model_store=store, address="127.0.0.1",
                                version="sim", sample_seconds=sample_seconds, heartbeat_seconds=heartbeat_seconds)
                       for name in names]
        for agent in self.agents:
            agent.register()
        self._seed_work(engines, downloads)
        self.lag: list[float] = []  # seconds each tick started after its due time

    def _seed_work(self, engines: int, downloads: int) -> None:
        from deployments.models import Deployment, ModelCopy, ModelRepo

        model, _ = ModelRepo.objects.get_or_create(repo_id="sim/model-70b", revision="main",
                                                   defaults={"total_size": 140 * 10**9})
        for agent in self.agents[:engines]:
            d, _ = Deployment.objects.update_or_create(
                name=f"{agent.name}-engine", defaults={"model": model, "node_id": agent.node_id, "port": 8000,
                                                       "status": Deployment.Status.READY, "pid": os.getpid()})
            agent.deployment_id = d.pk
        for agent in self.agents[engines:engines + downloads]:
            agent.copy, _ = ModelCopy.objects.update_or_create(
                model=model, node_id=agent.node_id,
                defaults={"state": ModelCopy.State.DOWNLOADING, "bytes_total": model.total_size, "bytes_done": 0})
            agent.copy = ModelCopy.objects.select_related("node").get(pk=agent.copy.pk)

    def run(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Tick every agent each sample_seconds for `seconds`, their phases spread over the interval."""
        stop = stop or threading.Event()
        start = time.monotonic()
        period = self.agents[0].sample_seconds if self.agents else 1.0
        due = [(start + k * period / len(self.agents), k) for k in range(len(self.agents))]
        heapq.heapify(due)
        while due and not stop.is_set():
            at, k = heapq.heappop(due)
            if at - start >= seconds:
                break
            wait = at - time.monotonic()
            if wait > 0 and stop.wait(wait):
                break
            self.lag.append(max(0.0, time.monotonic() - at))
            self.agents[k].tick()
            heapq.heappush(due, (at + period, k))

    def published(self) -> dict[int, list[float]]:
        """Sample times each node published, by node id."""
        return {agent.node_id: agent.published for agent in self.agents}

    def close(self) -> None:
        self.boundaries.close()


def _seed(name: str) -> int:
    return sum(map(ord, name)) * 31 % 10_000


# -- browsers ---------------------------------------------------------------------------------------

def pages(node_ids: list[int], deployment_ids: list[int], browsers: int, fleet_share: float = 0.6,
          node_share: float = 0.3, per_node_fleet: bool = False) -> list[list[str]]:
    """What each browser watches, in a fleet's usual proportions: most on the fleet page, some on one
    node's page, a few on a deployment's page. `per_node_fleet`: the fleet page as it was before the
    fleet feed, one node topic per card (at most 100, the server's limit per socket)."""
    rng = random.Random(7)
    fleet = round(browsers * fleet_share)
    nodes = round(browsers * node_share) if deployment_ids else browsers - fleet
    plan = [[f"node:{n}" for n in node_ids[:100]] if per_node_fleet else ["fleet"]] * fleet
    plan += [[f"node:{rng.choice(node_ids)}"] for _ in range(nodes)]
    plan += [[f"deployment:{rng.choice(deployment_ids)}"] for _ in range(browsers - fleet - nodes)]
    return plan


async def browse(url: str, cookie: str, origin: str, plan: list[list[str]], seconds: float) -> list[dict]:
    """One WebSocket per entry of `plan`, subscribed to its topics for `seconds`. For each: when it
    subscribed (`opened`), when it was ready (its first answer came), every node sample that reached
    it as [node id, sample t, arrival] (with LIVE_TRACE on a fleet page, + [published, heard by the web
    process, flushed by its feed]), and when its socket closed before the end (`closed`), if it did."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, WebSocketException

    async def one(topics: list[str]) -> dict:
        seen = {"topics": topics, "opened": time.time(), "ready": None, "samples": [], "messages": 0, "closed": None}
        end = time.monotonic() + seconds
        try:
            async with connect(url, additional_headers={"Cookie": cookie, "Origin": origin}, max_size=2**24) as ws:
                for i in range(0, len(topics), 50):  # as static/panel/live.js: at most 50 topics a message
                    await ws.send(json.dumps({"subscribe": topics[i:i + 50]}))
                while time.monotonic() < end:
                    try:
                        raw = await asyncio.wait_for(ws.recv(), timeout=max(0.05, end - time.monotonic()))
                    except asyncio.TimeoutError:
                        break
                    arrived = time.time()
                    message = json.loads(raw)
                    seen["ready"] = seen["ready"] or arrived  # the first answer: snapshots come first
                    if message.get("snapshot"):
                        continue
                    seen["messages"] += 1
                    if message.get("kind") == "nodes":
                        flushed = message.get("flushed")  # with LIVE_TRACE: the stages' times too
                        seen["samples"] += [[int(k), v["t"], arrived] + ([v["pub"], v["heard"], flushed] if flushed else [])
                                            for k, v in message["data"]["nodes"].items()]
                    elif message.get("kind") == "sample":
                        seen["samples"].append([int(message["topic"].split(":")[1]), message["data"]["t"], arrived])
        except (OSError, ConnectionClosed, WebSocketException):
            seen["closed"] = time.time()  # a socket that died (or never opened) still owes what it missed
        return seen

    return await asyncio.gather(*(one(topics) for topics in plan))


def account(published: dict[int, list[float]], seen: list[dict], end: float, margin: float = 2.0) -> dict:
    """Latencies (s) of every sample a browser received, and the samples each should have received
    that never came: those of the nodes it watches, published from `margin` s after it was ready (or
    subscribed, if it never heard anything) until `margin` s before `end`, the run's end. Every
    browser's window ends there, not at its own last arrival: a socket that died mid-run, or never
    answered, lost everything published after it went quiet."""
    latencies, expected, lost = [], 0, 0
    for browser in seen:
        got = {(node, t) for node, t, *_ in browser["samples"]}
        latencies += [arrived - t for _, t, arrived, *_ in browser["samples"]]
        if browser["topics"] == ["fleet"]:
            watched = list(published)
        else:
            watched = [int(topic.split(":")[1]) for topic in browser["topics"] if topic.startswith("node:")]
        start = browser["ready"] or browser["opened"]
        for node in watched:
            for t in published.get(node, []):
                if start + margin <= t <= end - margin:
                    expected += 1
                    lost += (node, t) not in got
    return {"latencies": latencies, "expected": expected, "lost": lost,
            "closed": sum(browser.get("closed") is not None for browser in seen)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--names", required=True, help="comma-separated node names")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--engines", type=int, default=0)
    parser.add_argument("--downloads", type=int, default=0)
    parser.add_argument("--ready-file", help="written once every node registered")
    parser.add_argument("--go-file", help="start ticking once this file exists")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
    import django

    django.setup()
    fleet = Fleet(args.names.split(","), gpus=args.gpus, engines=args.engines, downloads=args.downloads)
    deployments = [a.deployment_id for a in fleet.agents if hasattr(a, "deployment_id")]
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps({"nodes": [a.node_id for a in fleet.agents], "deployments": deployments}))
    while args.go_file and not Path(args.go_file).exists():
        time.sleep(0.05)
    cpu = time.process_time()
    fleet.run(args.seconds)
    Path(args.out).write_text(json.dumps({"published": fleet.published(), "lag": fleet.lag,
                                          "cpu_s": time.process_time() - cpu, "seconds": args.seconds}))
    fleet.close()


if __name__ == "__main__":
    main()
