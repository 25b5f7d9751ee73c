"""Warm start against cold start of the real CPU engine, without --enforce-eager (its compile cache is real).

The tiny model (var/tiny-model, scripts/install-engine) is served by `vllm serve` (.engine-venv) twice with the
same VLLM_CACHE_ROOT, a fresh folder laid out as the panel lays it out (host/compilecache.py: the model store's
`.compile-cache/<model>/<key>`): the first start compiles and fills it (cold), the second loads from it (warm).
A third start with a flag that changes the graph (--max-num-seqs; --no-changed skips it) gets a key of its own
and must miss. This is the real-engine check that the cache is used on a second start and missed after a settings
change (exit 1 if not): three CPU starts without --enforce-eager take minutes here, too long for the test suite.
Each start is timed from spawn to the first /health 200, its phases read from its log as the panel reads them
(host/loadphases.py), and what its compile cache did from the same lines the panel uses (compilecache.HitWatch).

    PYTHONPATH=$PWD .venv/bin/python perf/warm_start.py [--rounds 1] [--no-changed]

Last line: cold_s, warm_s, warm_cold_ratio (median over rounds; < 1 means warm is faster), each phase's seconds
cold and warm, the compile cache's verdict (compilecache.HitWatch) and size, the changed start's seconds and
verdict and warm_changed_ratio, load1_start and load1_end. The first start also pays a cold page cache for vLLM's
own files; the changed start, last, does not, so changed_s (and warm_changed_ratio) is the fairer cold figure.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deployments.host import compilecache, loadphases, osuser, processenv, processes, serveargv, vllm  # noqa: E402
from vllmbench import VLLM, free_port  # noqa: E402

TINY_MODEL = ROOT / "var" / "tiny-model"
ARGS = {"max-model-len": 1024, "served-model-name": "tiny"}  # no enforce-eager: torch.compile runs
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def start(cache_root: str, workdir: Path, name: str, args: dict) -> dict:
    """One start to /health: seconds, phases and the compile cache's verdict; the engine stopped after."""
    port = free_port()
    argv = serveargv.build_argv(str(VLLM), str(TINY_MODEL), port, "127.0.0.1", args)
    env = processenv.deployment_env({**ENV, "VLLM_CACHE_ROOT": cache_root})
    log_path = workdir / f"{name}.log"
    warm_before = compilecache.has_artifacts(cache_root)
    t0 = time.monotonic()
    handle = processes.launch(processes.EngineSpec(argv=argv, env=env, log_path=log_path))
    clock, hits, offset = loadphases.PhaseClock(), compilecache.HitWatch(), 0
    try:
        while True:
            now = time.monotonic() - t0
            with open(log_path, errors="replace") as f:
                f.seek(offset)
                text = f.read()
                offset += len(text.encode())
            for line in text.splitlines():
                clock.feed(line, now)
                hits.feed(line)
            if vllm.health(f"http://127.0.0.1:{port}", timeout=1.0):
                break
            if not processes.alive(handle.pid) or now > 900:
                raise SystemExit(f"the engine did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        seconds = time.monotonic() - t0
        clock.finish(seconds)
    finally:
        processes.stop(handle.pgid, term_timeout_s=10, kill_timeout_s=5)
    row = {"seconds": round(seconds, 2), "phases": clock.totals(), "warm_before": warm_before,
           "cache": hits.verdict(), "cache_lines": hits.lines, "cache_bytes": compilecache.size_bytes(cache_root)}
    print(f"{name}: {row['seconds']:.1f} s to /health; phases {row['phases']}; folder held artifacts before: "
          f"{warm_before}; cache {row['cache']} ({row['cache_bytes'] / 2**20:.1f} MiB after); "
          f"{'; '.join(hits.lines[:2])}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-changed", dest="changed", action="store_false",
                        help="skip the third start, with a graph flag changed (it must miss)")
    args = parser.parse_args()
    if not VLLM.exists() or not (TINY_MODEL / "config.json").exists():
        raise SystemExit("needs the CPU engine and the tiny model: run scripts/install-engine")
    load_start = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="perf-warm-"))
    user = osuser.current()
    colds, warms, changes = [], [], []
    try:
        for r in range(args.rounds):
            store = workdir / f"store{r}"
            store.mkdir()
            version = serveargv.engine_version(str(VLLM))
            key = compilecache.cache_key("local", version, ARGS, ENV)
            cache = compilecache.prepare(store, TINY_MODEL, key, user).path
            colds.append(start(cache, workdir, f"round{r}-cold", ARGS))
            warms.append(start(cache, workdir, f"round{r}-warm", ARGS))
            if args.changed:
                changed = {**ARGS, "max-num-seqs": 8}
                other = compilecache.prepare(store, TINY_MODEL, compilecache.cache_key("local", version, changed, ENV),
                                             user).path
                changes.append(start(other, workdir, f"round{r}-changed", changed))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    cold_s = statistics.median(c["seconds"] for c in colds)
    warm_s = statistics.median(w["seconds"] for w in warms)
    figures = {"cold_s": round(cold_s, 2), "warm_s": round(warm_s, 2), "warm_cold_ratio": round(warm_s / cold_s, 3)}
    for kind, rows in (("cold", colds), ("warm", warms)):
        for phase in loadphases.PHASES:
            values = [row["phases"][phase] for row in rows if phase in row["phases"]]
            if values:
                figures[f"{kind}_{phase}_s"] = round(statistics.median(values), 2)
    figures.update(cold_cache=colds[-1]["cache"], warm_cache=warms[-1]["cache"],
                   warm_folder_had_artifacts=warms[-1]["warm_before"], cache_mib=round(warms[-1]["cache_bytes"] / 2**20, 1),
                   **({"changed_s": changes[-1]["seconds"], "warm_changed_ratio": round(warm_s / changes[-1]["seconds"], 3),
                       "changed_cache": changes[-1]["cache"],
                       "changed_folder_had_artifacts": changes[-1]["warm_before"]} if changes else {}),
                   rounds=args.rounds, load1_start=round(load_start, 2), load1_end=round(os.getloadavg()[0], 2))
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    used = all(w["warm_before"] and w["cache"] in ("hit", "partial", "recompiled") for w in warms)
    if not used or any(c["warm_before"] or c["cache"] != "miss" for c in changes):
        raise SystemExit("the compile cache was not used on the second start, or a changed setting did not miss it")


if __name__ == "__main__":
    main()
