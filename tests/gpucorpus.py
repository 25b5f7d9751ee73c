"""The GPU log corpus (tests/fixtures/gpu_logs/): what vLLM 0.32's CUDA build prints while a TP=8
DeepSeek-V3-architecture model (Kimi-K2.5 INT4, 64 safetensors shards, 547 GB, TRITON_MLA) loads, one log per weights
loader, each line with its time since launch. Read it, replay it at a speed, or write it again
(`python -m tests.gpucorpus write`).

Corpus line: `@t=<seconds since launch> <the log line as vLLM prints it>`. A tqdm bar update that tqdm ends with \\r
(every one but the bar's last) is replayed with \\r, as the engine's log file has it. Which vLLM source file and log
call each message comes from: tests/fixtures/gpu_logs/README.md.

`python tests/gpucorpus.py replay FILE --speed 200 [--port P]` prints FILE's lines at their time divided by the speed
(stdout, flushed), then, with --port, answers GET /health with 200 until killed: a GPU engine's load without a GPU.
Standard library only.
"""
from __future__ import annotations

import random
import re
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

DIR = Path(__file__).resolve().parent / "fixtures" / "gpu_logs"
LOADERS = ("safetensors", "fastsafetensors", "runai_streamer", "sharded_state")
_LINE = re.compile(r"^@t=([\d.]+) (.*)$")
_BAR = re.compile(r"(?:% Completed \||%\|).*\]$")


def path(loader: str) -> Path:
    return DIR / f"tp8-kimi-k2.5-int4-{loader}.txt"


def read(file: Path) -> list[tuple[float, str]]:
    """(seconds since launch, line) for each corpus line."""
    out = []
    for raw in file.read_text().splitlines():
        if m := _LINE.match(raw):
            out.append((float(m[1]), m[2]))
    return out


def is_bar_update(line: str, following: str | None) -> bool:
    """A tqdm update that a later update of the same bar overwrites (ends with \\r in the log file)."""
    if not _BAR.search(line) or following is None or not _BAR.search(following):
        return False
    return line.split(":", 1)[0] == following.split(":", 1)[0]


def replay(file: Path, speed: float, out=sys.stdout) -> None:
    """Print each line at its time / speed after the start."""
    lines, start = read(file), time.monotonic()
    for i, (t, line) in enumerate(lines):
        wait = start + t / speed - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        following = lines[i + 1][1] if i + 1 < len(lines) else None
        out.write(line + ("\r" if is_bar_update(line, following) else "\n"))
        out.flush()


def serve_health(port: int) -> None:
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", port), Health).serve_forever()


# ---- writing the corpus (deterministic: a fixed seed, a fixed launch time) ----

LAUNCH = datetime(2026, 12, 4, 9, 0, 0)
MODEL = "/models/Kimi-K2.5-INT4"
API, CORE, WORKERS = 3712, 3877, [4101 + r for r in range(8)]
WEIGHTS_START, WEIGHTS_END = 48.0, 1790.0  # the real day: ~36 min in all, ~29 of them reading 547 GB


class Log:
    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def at(self, t: float, who: str | None, source: str, message: str, level: str = "INFO") -> None:
        stamp = (LAUNCH + timedelta(seconds=int(t))).strftime("%m-%d %H:%M:%S")
        self.lines.append((t, (f"({who}) " if who else "") + f"{level} {stamp} [{source}] {message}"))

    def bare(self, t: float, text: str) -> None:
        self.lines.append((t, text))

    def text(self) -> str:
        return "".join(f"@t={t:.2f} {line}\n" for t, line in sorted(self.lines, key=lambda x: x[0]))


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def bar(desc: str, n: int, total: int, elapsed: float, ascii_bar: bool = False) -> str:
    """tqdm's line: weight_utils._BAR_FORMAT for the loaders, tqdm's default format for the graph capture."""
    pct = 100 * n / total
    if n == 0:
        rest, rate = "?", "?it/s"
    else:
        per = elapsed / n
        rest = _clock(per * (total - n))
        rate = f"{per:.2f}s/it" if per >= 1 else f"{1 / per:.2f}it/s"
    if ascii_bar:
        filled = "█" * int(10 * n / total)
        return f"{desc}: {pct:3.0f}%|{filled:<10}| {n}/{total} [{_clock(elapsed)}<{rest}, {rate}]"
    return f"{desc}: {pct:3.0f}% Completed | {n}/{total} [{_clock(elapsed)}<{rest}, {rate}]"


def worker(rank: int) -> str:
    return f"Worker_TP{rank} pid={WORKERS[rank]}"


def _weights(log: Log, loader: str, rng: random.Random) -> None:
    span = WEIGHTS_END - WEIGHTS_START
    steps = {"safetensors": (64, "Loading safetensors checkpoint shards"),
             "fastsafetensors": (8, "Loading safetensors using Fastsafetensor loader"),  # 64 files, 8 ranks a step
             "runai_streamer": (143872, "Loading safetensors using Runai Model Streamer")}  # counts tensors
    if loader == "sharded_state":
        return  # ShardedStateLoader.load_weights reads model-rank-N-part-*.safetensors with no progress bar
    total, desc = steps[loader]
    if loader == "runai_streamer":
        ticks = [min(total, int(total * k / 116)) for k in range(117)]  # an update about every 15 s
    else:
        ticks = list(range(total + 1))
    weights = [rng.uniform(0.8, 1.2) for _ in ticks[1:]]
    times, t = [WEIGHTS_START], WEIGHTS_START
    for w in weights:
        t += span * w / sum(weights)
        times.append(t)
    for n, t in zip(ticks, times):
        log.bare(round(t, 2), bar(desc, n, total, t - WEIGHTS_START))


def corpus(loader: str) -> str:
    rng = random.Random(f"kimi-{loader}")
    log = Log()
    a, c = f"APIServer pid={API}", f"EngineCore pid={CORE}"
    fmt = {"safetensors": "auto", "fastsafetensors": "fastsafetensors", "runai_streamer": "runai_streamer",
           "sharded_state": "sharded_state"}[loader]
    log.at(0.0, a, "api_utils.py:286", f"non-default args: {{'model_tag': '{MODEL}', 'tensor_parallel_size': 8, "
           f"'load_format': '{fmt}', 'attention_backend': 'TRITON_MLA', 'max_model_len': 131072}}")
    log.at(9.1, a, "model.py:733", "Resolved architecture: DeepseekV3ForCausalLM")
    log.at(9.1, a, "model.py:2152", "Using max model len 131072")
    log.at(14.3, c, "core.py:133", f"Initializing a V1 LLM engine (v0.32.0) with config: model='{MODEL}', "
           f"tokenizer='{MODEL}', dtype=torch.bfloat16, max_seq_len=131072, load_format={fmt}, tensor_parallel_size=8, "
           "pipeline_parallel_size=1, data_parallel_size=1, quantization=compressed-tensors, enforce_eager=False")
    log.at(14.4, c, "multiproc_executor.py:153", "DP group leader: node_rank=0, node_rank_within_dp=0, "
           "master_addr=127.0.0.1, mq_connect_ip=10.0.0.5 (local), world_size=8, local_world_size=8")
    for r in range(8):
        t = 29.0 + 0.2 * r
        log.at(t, worker(r), "parallel_state.py:1906", f"world_size=8 rank={r} local_rank={r} "
               "distributed_init_method=tcp://127.0.0.1:41955 backend=nccl")
    log.at(31.0, worker(0), "pynccl.py:111", "vLLM is using nccl==2.27.5")
    p2p = "/root/.cache/vllm/gpu_p2p_access_cache_for_0,1,2,3,4,5,6,7.json"
    log.at(31.5, worker(0), "all_reduce_utils.py:378", f"generating GPU P2P access cache in {p2p}")
    for r in range(8):
        log.at(33.2, worker(r), "all_reduce_utils.py:402", f"reading GPU P2P access cache from {p2p}")
    for r in range(8):
        log.at(34.0, worker(r), "parallel_state.py:2350", f"rank {r} in world size 8 is assigned as DP rank 0, "
               f"PP rank 0, PCP rank 0, TP rank {r}, ETP rank {r}, EP rank N/A, EPLB rank N/A")
    for r in range(8):
        log.at(36.0, worker(r), "gpu_model_runner.py:4100", f"Starting to load model {MODEL}...")
    log.at(37.0, worker(0), "cuda.py:536", "Using TRITON_MLA attention backend out of potential backends: "
           "['TRITON_MLA'].")
    log.at(38.0, worker(0), "base_loader.py:82", "Initializing model took 1.873204 seconds")
    if loader in ("safetensors", "fastsafetensors"):
        log.at(39.0, worker(0), "weight_utils.py:1108", "Filesystem type for checkpoints: EXT4. Checkpoint size: "
               "509.44 GiB. Available RAM: 1843.12 GiB.")
    _weights(log, loader, rng)
    took = WEIGHTS_END - WEIGHTS_START + 2.0
    if loader == "runai_streamer":  # the streamer's own logger, in each worker
        stamp = (LAUNCH + timedelta(seconds=WEIGHTS_END)).strftime("%Y-%m-%d %H:%M:%S")
        for r in range(8):
            log.bare(WEIGHTS_END + 0.5, f"({worker(r)}) [{stamp}] INFO file_streamer.py:66: [RunAI Streamer] Overall "
                     f"time to stream 63.7 GiB of all files to cuda:{r}: {took - 2.0:.2f}s, 37.4 MiB/s")
    source = "sharded_state_loader.py:202" if loader == "sharded_state" else "default_loader.py:501"
    for r in range(8):
        t = WEIGHTS_END + 1.0 + 0.4 * r
        if loader == "sharded_state":  # each rank reads its own part: no bar, one line at the end
            t = WEIGHTS_END - 30.0 + 4.0 * r
        log.at(t, worker(r), source, f"Loading weights took {took + rng.uniform(-20, 0):.2f} seconds")
        log.at(t + 1.5, worker(r), "gpu_model_runner.py:5150",
               f"Model loading took 63.71 GiB memory and {t + 1.5 - 36.0:.6f} seconds")
    t0 = WEIGHTS_END + 8.0
    log.at(t0, worker(0), "backends.py:652", "Using cache directory: /root/.cache/vllm/torch_compile_cache/"
           "5f0c1a2b3d/rank_0_0/backbone for vLLM's torch.compile")
    log.at(t0 + 41.0, worker(0), "backends.py:1167", "Dynamo bytecode transform time: 40.62 s")
    log.at(t0 + 44.0, worker(0), "backends.py:377", "Cache the graph of compile range (1, 8192) for later use")
    log.at(t0 + 108.0, worker(0), "backends.py:393", "Compiling a graph for compile range (1, 8192) takes 63.88 s")
    log.at(t0 + 110.0, worker(0), "monitor.py:53", "torch.compile took 109.47 s in total")
    t1 = t0 + 121.0
    log.at(t1, worker(0), "monitor.py:81", "Initial profiling/warmup run took 10.36 s")
    log.at(t1 + 4.0, worker(0), "gpu_worker.py:760", "Available KV cache memory: 9.87 GiB")
    log.at(t1 + 5.0, c, "kv_cache_utils.py:2327", "GPU KV cache size: 151,552 tokens, Maximum concurrency for "
           "131,072 tokens per request: 1.16x")
    t2, capture = t1 + 8.0, 0.0
    for desc, total, each in (("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)", 67, 1.9),
                              ("Capturing CUDA graphs (decode, FULL)", 35, 1.2)):
        for n in range(total + 1):
            if n in (0, total) or n % 4 == 0:
                log.bare(round(t2 + capture + n * each, 2), bar(desc, n, total, n * each, ascii_bar=True))
        capture += total * each + 1.0
    t3 = t2 + capture
    log.at(t3, worker(0), "gpu_model_runner.py:6582", f"Graph capturing finished in {capture:.0f} secs, took 1.84 GiB")
    log.at(t3 + 2.0, c, "core.py:402", f"init engine (profile, create kv cache, warmup model) took {t3 + 2 - t0:.2f} s")
    t4 = t3 + 9.0
    log.at(t4, a, "entry.py:140", "Starting vLLM server on http://0.0.0.0:8000")
    log.bare(t4 + 0.5, f"INFO:     Started server process [{API}]")
    log.bare(t4 + 0.5, "INFO:     Waiting for application startup.")
    log.bare(t4 + 0.6, "INFO:     Application startup complete.")
    return log.text()


def write() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    for loader in LOADERS:
        path(loader).write_text(corpus(loader))


def main(argv: list[str]) -> None:
    if argv[:1] == ["write"]:
        write()
    elif argv[:1] == ["replay"]:
        file, speed = Path(argv[1]), float(argv[argv.index("--speed") + 1]) if "--speed" in argv else 1.0
        replay(file, speed)
        if "--port" in argv:
            serve_health(int(argv[argv.index("--port") + 1]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
