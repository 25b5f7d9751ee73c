"""The load-time figures: pre-warm against a plain `cat`, and how well a load's time to ready is predicted.

1. prewarm_ratio: the same files, dropped from the page cache (posix_fadvise DONTNEED per file)
   before each read, read by host/pagecache.prewarm (parallel) and by one sequential `cat f... >
   /dev/null`; rounds alternate which goes first, the median of each is compared (target >= 1.0).
2. predict_err_pct: the panel deploys the real CPU engine and restarts it LOADS times with the same
   flags, through its own services and node-side plan (plan.deployment_run, the node agent's task,
   run here on a fresh SQLite database and an embedded Redis): each load is kept in the history the
   panel learns from (its `load` step), the node's very first start included. Before each restart the
   time to ready is predicted from that history (loads.load_history, as the deployment page's
   forecast does) and compared with the time to ready the load then took (target <= 10 over the
   LOADS restarts). The node registers as an agent does when it starts: it asks the engine its
   version and flags, and measures the store's read rate.

Run: PYTHONPATH=$PWD .venv/bin/python perf/prewarm.py [--files 4 --mib 256 --rounds 3 --loads 3]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments.host import loadphases, pagecache  # noqa: E402
from panelctl import launcher  # noqa: E402
from inprocess import start_panel, stop_engines  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

VLLM = Path(os.environ.get("ENGINE_VENV", ROOT / ".engine-venv")) / "bin" / "vllm"


def _drop_all(files):
    for f in files:
        pagecache.drop(f)
    return pagecache.residency(files).percent


def throughput(folder: Path, count: int, mib: int, rounds: int) -> dict:
    files = []
    for i in range(count):
        path = folder / f"model-{i:05d}.safetensors"
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        files.append(path)
    os.sync()
    total = sum(p.stat().st_size for p in files)
    peers = {"cat": lambda: subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True),
             "prewarm": lambda: pagecache.prewarm(files, workers=min(8, count))}
    took, residue, resident = {"cat": [], "prewarm": []}, [], []
    for n in range(rounds):  # the order alternates, so neither always reads right after the other
        for name in ("cat", "prewarm") if n % 2 == 0 else ("prewarm", "cat"):
            residue.append(_drop_all(files))
            t = time.perf_counter()
            peers[name]()
            took[name].append(time.perf_counter() - t)
            if name == "prewarm":
                resident.append(pagecache.residency(files).percent)
    cat_s, warm_s = took["cat"], took["prewarm"]
    cat_bps, warm_bps = total / statistics.median(cat_s), total / statistics.median(warm_s)
    return {"prewarm_gbps": round(warm_bps / 1e9, 3), "cat_gbps": round(cat_bps / 1e9, 3),
            "prewarm_ratio": round(warm_bps / cat_bps, 3), "resident_after_prewarm_pct": min(resident),
            "resident_after_drop_pct": max(residue), "bytes": total}


ENGINE_ARGS = {"enforce-eager": True, "max-model-len": 1024, "served-model-name": "tiny"}
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _deploy_once(d, node, model):
    """One load through the panel: deploy (or restart), the node's plan to ready and its smoke test, stop."""
    from django.db import transaction

    from deployments import selectors
    from deployments.models import Deployment
    from deployments.node import plan, watch
    from deployments.services import deploys

    with transaction.atomic():  # as the API view: the deploy decision under the node's lock
        d = (deploys.deployment_redeploy(d) if d else deploys.deployment_create(
            model=model, node=node, gpu_indices=[], port=launcher.free_port(), engine_args=ENGINE_ARGS, env=ENGINE_ENV,
            name="prewarm-perf"))
    try:
        plan.deployment_run(d.pk)  # what the node agent's deployment_run task does
        d.refresh_from_db()
        if d.status != Deployment.Status.READY:
            raise SystemExit(f"the deploy did not get ready: {d.status}: {d.status_message}\n{d.log_tail}")
        load = selectors.load_events(deployment=d, started__gte=d.started).first()  # the load kept for its history
        if load is None:
            raise SystemExit("the panel kept no history of the load it just followed")
    finally:
        with transaction.atomic():
            deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
        watch.deployment_halt(d.pk)
    # Time to ready, as the prediction counts it: launch (the deployment's start) to the smoke test.
    return d, next(start for phase, start, _ in load.data["segments"] if phase == "smoke_test")


def prediction(loads: int) -> dict:
    model_path = ROOT / "var" / "tiny-model"
    if not VLLM.exists() or not model_path.exists():
        return {"predict_err_pct": "nan", "predict_note": "no CPU engine or tiny model here"}
    var = Path(tempfile.mkdtemp(prefix="perf-prewarm-"))
    children = launcher.Children()
    try:
        # A node's vLLM cache (VLLM_CACHE_ROOT) starts empty here, as on a node's first deploy of the model.
        start_panel(var, children, VLLM_BIN=str(VLLM), VLLM_CACHE_ROOT=str(var / "vllm-cache"),
                    CHANNELS_PREFIX=f"perfprewarm{os.getpid()}")
        from deployments import tasks
        from deployments.agent import Agent
        from deployments.models import Deployment, Node
        from deployments import loads
        from deployments.services import repos

        agent = Agent(name="perf-node", model_store=str(var / "store"), address="127.0.0.1", version="perf")
        agent.register()  # in a thread, as at an agent's start: the engine's version and flags, the store's read rate
        node = wait_until(lambda: Node.objects.exclude(engine_flags=[]).filter(pk=agent.node_id).first(), timeout=300,
                          message="the engine's flags")
        model = repos.model_add_local(node, str(model_path))
        tasks.model_inspect_local(model.pk, node.pk)  # the node's worker reads the folder
        d, took, errors, predicted_each = None, [], [], []
        for n in range(loads + 1):  # the node's first start, then LOADS restarts
            if d is not None:  # what the page forecasts before the restart's first log line
                history, basis, scale, _ = loads.load_history(Deployment.objects.get(pk=d.pk))
                forecast = loadphases.predict(loadphases.PhaseClock(), 0.0, history, basis, scale)
                if forecast is None:
                    raise SystemExit(f"after {n} load(s) the panel kept none to forecast from ({basis})")
            d, actual = _deploy_once(d, node, model)
            took.append(round(actual, 1))
            if n:
                predicted_each.append(forecast.total_s)
                errors.append(100.0 * abs(forecast.total_s - actual) / actual)
        kept = len(loads.load_history(d)[0])
    finally:
        stop_engines()
        children.stop()
        shutil.rmtree(var, ignore_errors=True)
    return {"predict_err_pct": round(max(errors), 1), "predict_err_each_pct": "/".join(f"{e:.1f}" for e in errors),
            "predicted_s_each": "/".join(f"{p:.1f}" for p in predicted_each), "first_start_s": took[0],
            "load_s_each": "/".join(map(str, took[1:])), "history_loads": kept}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loads", type=int, default=3, help="restarts after the first start (0: no engine)")
    ap.add_argument("--dir", default=str(ROOT / "var"), help="a folder on the model store's filesystem (not tmpfs)")
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)  # var/ is made by the first ./panel start or test
    folder = Path(tempfile.mkdtemp(prefix="prewarm-", dir=args.dir))
    try:
        result = throughput(folder, args.files, args.mib, args.rounds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.loads >= 1:
        result.update(prediction(args.loads))
    print(" ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
