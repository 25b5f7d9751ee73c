"""The panel's own overhead of a two-node deploy over a one-node deploy of the same engine.

The panel runs as in production (embedded Redis, uvicorn, real node agents on their own queues, the CPU
vLLM engine and the tiny model), here with two agents on this machine as two nodes. Each round deploys
through the REST API, one after the other, the one-node deploy first in even rounds and second in odd ones:
  one-node: TP 1 on node A;
  two-node: TP 2 over nodes A (head) and B (a headless worker rank), vLLM's `--nnodes 2` launch.
For each, the panel's part of the time, not vLLM's:
  request -> every rank's engine process started (its /proc start time)
  + the head's first /health 200 (polled here every 10 ms; it answers once every rank is loaded) -> the API shows ready.
overhead = the two-node figure - the one-node figure of the same round (pre-flight, the ranks' coordination).

    python perf/multinode_overhead.py [--rounds 3]

Last line: name=value pairs; overhead_p95_s is the target (<= 1 s). SQLite in a temporary folder.
"""
import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

from panelctl import launcher  # noqa: E402
from deploy_overhead import FirstHealth, percentile, process_started_at, wait  # noqa: E402
from inprocess import start_panel, stop_engines  # noqa: E402

VLLM = ROOT / ".engine-venv" / "bin" / "vllm"
TINY_MODEL = ROOT / "var" / "tiny-model"
HEAD, WORKER = "perf-mn-a", "perf-mn-b"
ENGINE = {"served-model-name": "tiny", "max-model-len": 512, "max-num-seqs": 8, "enforce-eager": True}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def one_deploy(api: httpx.Client, model_id: int, name: str, workers: list) -> float:
    """Deploy, wait until shown ready, stop; the panel's seconds (see the module's docstring)."""
    from deployments.models import Deployment, DeploymentRank

    port = launcher.free_port()
    health = FirstHealth(port)
    body = {"model": model_id, "node": HEAD, "port": port, "name": name, "preset": "none", "env": ENV,
            "engine_args": {**ENGINE, "tensor-parallel-size": 1 + len(workers)}, "workers": workers}
    if workers:
        body["master_port"] = launcher.free_port()
    sent = time.time()
    created = api.post("/api/deployments/", json=body)
    if created.status_code != 202:
        raise SystemExit(f"deploy refused: {created.status_code} {created.text[:500]}")
    pk = created.json()["id"]
    starts: dict[str, float] = {}

    def shown_ready():
        d = Deployment.objects.filter(pk=pk).values("pid", "status", "status_message").first()
        if d["pid"] and "head" not in starts:
            starts["head"] = process_started_at(d["pid"])
        for rank, pid in DeploymentRank.objects.filter(deployment_id=pk).exclude(pid=None).values_list("rank", "pid"):
            starts.setdefault(f"rank{rank}", process_started_at(pid))
        if d["status"] == "failed":
            raise SystemExit(f"{name} failed: {d['status_message']}")
        return time.time() if api.get(f"/api/deployments/{pk}/").json()["status"] == "ready" else None

    ready = wait(shown_ready, 900, f"{name} to show ready", interval=0.02)
    health.stop()
    if health.at is None or len(starts) != 1 + len(workers):
        raise SystemExit(f"{name}: no /health 200, or not every rank's start was seen ({sorted(starts)})")
    api.post(f"/api/deployments/{pk}/stop/")
    wait(lambda: api.get(f"/api/deployments/{pk}/").json()["status"] == "stopped", 120, f"{name} to stop")
    to_start, to_ready = max(starts.values()) - sent, ready - health.at
    print(f"{name}: request -> all {len(starts)} rank(s) started {to_start:.3f} s, engine loading "
          f"{health.at - max(starts.values()):.1f} s, first /health 200 -> shown ready {to_ready:.3f} s", flush=True)
    return to_start + to_ready


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not VLLM.exists() or not (TINY_MODEL / "config.json").exists():
        raise SystemExit("needs the CPU engine and the tiny model: run scripts/install-engine")
    var = Path(tempfile.mkdtemp(prefix="perf-multinode-"))
    children = launcher.Children()
    rows = []
    try:
        env = start_panel(var, children, PYTHONUNBUFFERED="1", VLLM_BIN=str(VLLM), VLLM_CACHE_ROOT=str(var / "vllm-cache"),
                          CHANNELS_PREFIX=f"perfmn{os.getpid()}")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        from django.contrib.auth import get_user_model

        from plumbing import tokens

        token = tokens.issue(get_user_model().objects.create_superuser("perf", "", "perf-password-1"))
        port = launcher.free_port()
        children.start("web", [launcher.PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--port", str(port),
                               "--log-level", "warning", "--no-access-log"], env)
        for name in (HEAD, WORKER):
            children.start(name, [launcher.PYTHON, "manage.py", "nodeagent", "--name", name, "--model-store",
                                  str(var / name), "--concurrency", "2"], env)
        launcher.wait_for_port(port, timeout=60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Token {token}"},
                          timeout=30) as api:
            from deployments.models import ModelCopy, Node
            from deployments.services import repos

            wait(lambda: Node.objects.filter(name__in=(HEAD, WORKER)).exclude(engine_version="").count() == 2, 240,
                 "both node agents and their engine's version")
            model = repos.model_add_local(Node.objects.get(name=HEAD), str(TINY_MODEL))
            wait(lambda: ModelCopy.objects.filter(model=model, state="ready").exists(), 120, "the model on the head")
            # The worker node has the same files (one disk here): a ready copy of the model there.
            ModelCopy.objects.create(model=model, node=Node.objects.get(name=WORKER), state="ready", path=str(TINY_MODEL))
            api.get("/api/deployments/").raise_for_status()
            for i in range(args.rounds):  # the order alternates, so neither layout always starts after the other
                took = {}
                for layout in ("one", "two") if i % 2 == 0 else ("two", "one"):
                    took[layout] = one_deploy(api, model.pk, f"{layout}-node-{i}",
                                              [{"node": WORKER, "gpus": []}] if layout == "two" else [])
                one, two = took["one"], took["two"]
                rows.append({"one": one, "two": two, "overhead": two - one})
                print(f"round {i}: panel one-node {one:.3f} s, two-node {two:.3f} s, overhead {two - one:.3f} s", flush=True)
    finally:
        stop_engines(ranks=True)
        children.stop()
    overhead = [r["overhead"] for r in rows]
    print(f"one_node_panel_p50_s={statistics.median(r['one'] for r in rows):.3f} "
          f"two_node_panel_p50_s={statistics.median(r['two'] for r in rows):.3f} "
          f"overhead_p50_s={statistics.median(overhead):.3f} rounds={len(rows)} overhead_p95_s={percentile(overhead, 95):.3f}")


if __name__ == "__main__":
    main()
