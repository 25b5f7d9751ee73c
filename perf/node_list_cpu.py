"""CPU of one node-list answer (GET /api/nodes/, 100 nodes x 8 GPUs with a sample each): composed from the kept
rows and the live part read from Redis (what each request costs now, on the fast lane or in Django), against
the peer measured in the same run: the rows rebuilt through Django's view, as after a change to a node. Also, in
the same run, what a cached answer costs through the web handler (plumbing/handler.py, called here as uvicorn
calls it): a repeated GET /api/deployments/ answered on the event loop (plumbing/fastlane.py) against the same
GET answered from the cache by Django (the lane forgets the request each time: the thread hop, middleware and
DRF), beside /healthz; and the node list's encoding with orjson (the panel's renderer) against DRF's own
JSONRenderer (the standard library's json).

    python perf/node_list_cpu.py [--nodes 100] [--rounds 300]

CPU time of this process (time.process_time, the handler's threads included; Server-Timing on, which says how each
answer was served), not wall time: the figures hold on a busy machine. A panel of its own under a temporary folder (perf/inprocess.py: SQLite, embedded Redis).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from panelctl import launcher  # noqa: E402
from perf.inprocess import start_panel  # noqa: E402

GIB = 2**30


def seed(nodes: int) -> None:
    from deployments import history
    from deployments.models import Gpu, Node
    from deployments.services import nodes as node_services

    for i in range(nodes):
        node = Node.objects.create(name=f"n{i:03d}", heartbeat_seconds=5.0)
        Gpu.objects.bulk_create([Gpu(node=node, index=g, uuid=f"GPU-{i}-{g}", name="NVIDIA H200", memory_total=141 * GIB)
                                 for g in range(8)])
        node_services.node_heartbeat(node.pk, disk_total=10**13, disk_free=4 * 10**12)
        history.push(node.pk, {"t": time.time(), "disk": {"free": 4 * 10**12, "total": 10**13},
                               "gpus": [{"index": g, "memory_used": 100 * GIB, "memory_total": 141 * GIB, "util_gpu": 97,
                                         "temperature_c": 61, "power_w": 650.5} for g in range(8)],
                               "host": {"ram_available": 10**12, "ram_total": 2 * 10**12, "load1": 3.2, "cpu_percent": 12.5,
                                        "net_rx_bps": 1e6, "net_tx_bps": 2e6}})


def cpu_ms(work, rounds: int) -> float:
    started = time.process_time()
    for _ in range(rounds):
        work()
    return (time.process_time() - started) / rounds * 1000


def through_handler(token: str, rounds: int) -> dict:
    """CPU ms per answer through the web handler: a cached list on the lane and through Django, and /healthz."""
    import asyncio

    from plumbing import fastlane
    from plumbing.handler import ThreadedASGIHandler

    handler = ThreadedASGIHandler(1)
    headers = [(b"host", b"localhost"), (b"authorization", f"Token {token}".encode())]

    async def get(path: str, how: str | None = None):
        sent, scope = [], {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                           "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                           "root_path": "", "headers": headers, "client": ("127.0.0.1", 50000),
                           "server": ("127.0.0.1", 8000)}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await handler(scope, receive, send)
        timing = {name.lower(): value for name, value in sent[0]["headers"]}.get(b"server-timing", b"")
        if sent[0]["status"] != 200 or (how and f"cache;desc={how}".encode() not in timing):
            raise SystemExit(f"{path}: {sent[0]['status']} {timing!r}, not answered by {how}")

    async def cpu(path: str, how: str | None = None, forget: bool = False) -> float:
        await get(path)  # Django answers (and caches, and teaches the lane)
        started = time.process_time()
        for _ in range(rounds):
            if forget:
                fastlane.learned.clear()
            await get(path, how)
        return (time.process_time() - started) / rounds * 1000

    async def all_three():
        return {"lane": await cpu("/api/deployments/", "lane"),
                "django": await cpu("/api/deployments/", "hit", forget=True), "healthz": await cpu("/healthz")}

    try:
        return asyncio.run(all_three())
    finally:
        handler.executor.shutdown()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    children = launcher.Children()
    try:
        start_panel(Path(tempfile.mkdtemp(prefix="perf-nodes-")), children, SERVER_TIMING="1")
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group
        from rest_framework.renderers import JSONRenderer
        from rest_framework.test import APIClient

        from plumbing import apicache, tokens

        seed(args.nodes)
        user = get_user_model().objects.create_user("perf")
        user.groups.add(Group.objects.get_or_create(name="operator")[0])
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(user)}")

        def through_django():
            response = api.get("/api/nodes/", HTTP_HOST="localhost")
            assert response.status_code == 200, response.content[:300]
            return response

        through_django()
        key = next(k for k in apicache.answers.entries if "/api/nodes/" in k[0])
        _, _, (part, rows, render) = apicache.answers.get(key)[1:]
        found = part.read(rows)
        size = len(render(part.merge(rows, found)))
        read = cpu_ms(lambda: part.read(rows), args.rounds)
        merge = cpu_ms(lambda: render(part.merge(rows, found)), args.rounds)

        def rebuilt():
            apicache.answers.clear()  # the rows are recomputed; the token check stays cached, as in production
            through_django()

        rebuild = cpu_ms(rebuilt, max(10, args.rounds // 10))
        merged = part.merge(rows, found)
        stdlib = JSONRenderer()
        encode = {"orjson": cpu_ms(lambda: render(merged), args.rounds),
                  "json": cpu_ms(lambda: stdlib.render(merged), max(10, args.rounds // 10))}
        hit = through_handler(tokens.issue(user), args.rounds)
    finally:
        children.stop()
    print(f"node list, {args.nodes} nodes x 8 GPUs, {size / 1000:.0f} KB: composed {read + merge:.2f} ms of CPU "
          f"(reading the live part {read:.2f} ms, merging and encoding {merge:.2f} ms); rows rebuilt through Django "
          f"{rebuild:.2f} ms ({rebuild / (read + merge):.1f}x); encoded with orjson {encode['orjson']:.2f} ms, with "
          f"json (DRF's JSONRenderer) {encode['json']:.2f} ms")
    print(f"a cached list's hit through the web handler: {hit['lane']:.2f} ms of CPU on the event loop, "
          f"{hit['django']:.2f} ms through Django ({hit['django'] / hit['lane']:.1f}x); /healthz {hit['healthz']:.2f} ms")
    print(f"composed_ms={read + merge:.2f} read_ms={read:.2f} merge_ms={merge:.2f} rebuilt_ms={rebuild:.2f} "
          f"orjson_ms={encode['orjson']:.2f} json_ms={encode['json']:.2f} hit_lane_ms={hit['lane']:.2f} "
          f"hit_django_ms={hit['django']:.2f} healthz_ms={hit['healthz']:.2f} bytes={size} nodes={args.nodes}")


if __name__ == "__main__":
    main()
