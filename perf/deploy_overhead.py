"""The panel's own overhead around a deploy, over repeated deploys of the real CPU engine.

The whole panel runs here as in production, the way tests/e2e start it: an embedded Redis, the
ASGI web server (uvicorn), a real node agent (Celery on its node queue) with the CPU vLLM engine
(.engine-venv) and the tiny model (var/tiny-model); the web server answers one API read first, as a
running panel has. Each round deploys through the REST API, waits
until the API shows it ready, then stops it. Two figures per round, both the panel's, not vLLM's:

  api_to_engine_start: the deploy request sent -> the engine process created (its /proc start time)
  health_to_ready:     the engine's first /health 200 (polled here every 10 ms) -> the API shows "ready"

    python perf/deploy_overhead.py [--rounds 5]

Last line: name=value pairs, p50 and p95 in seconds (the p95 figures named ..._p95_s).
Target: both p95 <= 1 s. Runs on SQLite in a temporary folder; needs scripts/install-engine's engine.
"""
import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from panelctl import launcher  # noqa: E402
from tests.conftest import wait_until  # noqa: E402
from inprocess import start_panel, stop_engines  # noqa: E402

VLLM = ROOT / ".engine-venv" / "bin" / "vllm"
TINY_MODEL = ROOT / "var" / "tiny-model"
NODE = "perf-node"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def wait(predicate, timeout: float, what: str, interval: float = 0.2):
    return wait_until(predicate, timeout=timeout, interval=interval, message=what)


def process_started_at(pid: int) -> float:
    """A process's start as wall-clock time, to 10 ms: /proc's start tick against the boot clock
    (psutil's create_time adds the whole-second boot time, an error of up to 1 s)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


class FirstHealth:
    """Polls the engine's /health every 10 ms from the deploy on; notes the first 200 (wall clock)."""

    def __init__(self, port: int):
        self.url, self.at, self._stop = f"http://127.0.0.1:{port}/health", None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with httpx.Client(timeout=1.0) as http:
            while not self._stop.is_set() and self.at is None:
                try:
                    if http.get(self.url).status_code == 200:
                        self.at = time.time()
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.01)

    def stop(self):
        self._stop.set()
        self._thread.join(5)


def one_round(api: httpx.Client, model_id: int, index: int) -> dict:
    from deployments.models import Deployment

    port = launcher.free_port()
    health = FirstHealth(port)
    body = {"model": model_id, "node": NODE, "port": port, "name": f"overhead-{index}",
            "engine_args": {"served-model-name": "tiny", "max-model-len": 2048, "enforce-eager": True},
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}}
    sent = time.time()
    created = api.post("/api/deployments/", json=body)
    answered = time.time()
    if created.status_code != 202:
        raise SystemExit(f"deploy refused: {created.status_code} {created.text[:500]}")
    pk = created.json()["id"]

    def shown_ready():
        status = api.get(f"/api/deployments/{pk}/").json()["status"]
        if status == "failed":
            raise SystemExit(f"the deploy failed: {api.get(f'/api/deployments/{pk}/').json()['status_message']}")
        return time.time() if status == "ready" else None

    started = {}

    def shown_ready_noting_the_engine():
        if not started:
            pid = Deployment.objects.filter(pk=pk).values_list("pid", flat=True).first()
            if pid:
                started["at"] = process_started_at(pid)
        return shown_ready()

    ready = wait(shown_ready_noting_the_engine, 900, "the deployment to show ready", interval=0.02)
    health.stop()
    d = Deployment.objects.get(pk=pk)
    if health.at is None or not started:
        raise SystemExit("no /health 200 or no engine start time was seen")
    steps = {e.step: e.started.timestamp() for e in d.events.all()}
    api.post(f"/api/deployments/{pk}/stop/")
    wait(lambda: api.get(f"/api/deployments/{pk}/").json()["status"] == "stopped", 120, "the stop")
    row = {"api_to_engine_start": started["at"] - sent, "health_to_ready": ready - health.at,
           "engine_start_to_health": health.at - started["at"], "api_answer": answered - sent}
    print(f"round {index}: request -> engine started {row['api_to_engine_start']:.3f} s (the API answered in "
          f"{row['api_answer']:.3f} s), engine loading "
          f"{row['engine_start_to_health']:.1f} s, first /health 200 -> shown ready {row['health_to_ready']:.3f} s; "
          f"steps after the request: " + ", ".join(f"{k} +{v - sent:.2f}" for k, v in sorted(steps.items(), key=lambda kv: kv[1])),
          flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not VLLM.exists() or not (TINY_MODEL / "config.json").exists():
        raise SystemExit("needs the CPU engine and the tiny model: run scripts/install-engine")
    var = Path(tempfile.mkdtemp(prefix="perf-deploy-"))
    children = launcher.Children()
    try:
        env = start_panel(var, children, PYTHONUNBUFFERED="1", VLLM_BIN=str(VLLM), VLLM_CACHE_ROOT=str(var / "vllm-cache"),
                          CHANNELS_PREFIX=f"perfdeploy{os.getpid()}")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll otherwise
        from django.contrib.auth import get_user_model

        from plumbing import tokens

        token = tokens.issue(get_user_model().objects.create_superuser("perf", "", "perf-password-1"))
        port = launcher.free_port()
        children.start("web", [launcher.PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--port", str(port),
                               "--log-level", "warning", "--no-access-log"], env)
        children.start("agent", [launcher.PYTHON, "manage.py", "nodeagent", "--name", NODE, "--model-store",
                                 str(var / "store"), "--concurrency", "2"], env)
        launcher.wait_for_port(port, timeout=60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Token {token}"},
                          timeout=30) as api:
            from deployments.models import Node

            wait(lambda: Node.objects.filter(name=NODE).exclude(engine_flags=[]).exists(), 180,
                 "the node agent and its engine's flags")
            from deployments.models import ModelCopy
            from deployments.services import repos

            model = repos.model_add_local(Node.objects.get(name=NODE), str(TINY_MODEL))  # as tests/e2e do
            wait(lambda: ModelCopy.objects.filter(model=model, state="ready").exists(), 120, "the local model on the node")
            api.get("/api/deployments/").raise_for_status()  # a running panel has served requests before a deploy
            rows = [one_round(api, model.pk, i) for i in range(args.rounds)]
    finally:
        stop_engines()
        children.stop()
    figures = {}
    for name in ("api_to_engine_start", "health_to_ready"):
        values = [row[name] for row in rows]
        figures[f"{name}_p50_s"] = statistics.median(values)
        figures[f"{name}_p95_s"] = percentile(values, 95)
    figures["engine_start_to_health_p50_s"] = statistics.median(row["engine_start_to_health"] for row in rows)
    print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()) + f" rounds={len(rows)}")


if __name__ == "__main__":
    main()
