"""CPU of one node-list answer (GET /api/nodes/, 100 nodes x 8 GPUs with a sample each): composed from the kept
rows and the live part read from Redis (what each request costs now, on the fast lane or in Django), against
the peer measured in the same run: the rows rebuilt through Django's view, as after a change to a node.

    python perf/node_list_cpu.py [--nodes 100] [--rounds 300]

CPU time of this process (time.process_time), not wall time: the figures hold on a busy machine. A panel of its
own under a temporary folder (perf/inprocess.py: SQLite, embedded Redis).
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    children = launcher.Children()
    try:
        start_panel(Path(tempfile.mkdtemp(prefix="perf-nodes-")), children)
        from django.contrib.auth import get_user_model
        from django.contrib.auth.models import Group
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
    finally:
        children.stop()
    print(f"node list, {args.nodes} nodes x 8 GPUs, {size / 1000:.0f} KB: composed {read + merge:.2f} ms of CPU "
          f"(reading the live part {read:.2f} ms, merging and encoding {merge:.2f} ms); rows rebuilt through Django "
          f"{rebuild:.2f} ms ({rebuild / (read + merge):.1f}x)")
    print(f"composed_ms={read + merge:.2f} read_ms={read:.2f} merge_ms={merge:.2f} rebuilt_ms={rebuild:.2f} "
          f"bytes={size} nodes={args.nodes}")


if __name__ == "__main__":
    main()
