"""An engine's log: which loading phase it is in and how far along, its first error, and reading
new lines or the last ones. Plain Python, no Django.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("starting", "loading_weights", "weights_loaded", "profiling_kv_cache", "graph_capture", "server_up")
# Overall percent at the start of each phase; loading_weights spans 5..60 by shard.
_PHASE_PERCENT = {"starting": 0, "loading_weights": 5, "weights_loaded": 60,
                  "profiling_kv_cache": 65, "graph_capture": 80, "server_up": 100}
# The weights' progress bar of each of vLLM's loaders: tqdm with its _BAR_FORMAT ("{desc}: {percentage:3.0f}% Completed
# | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]") and these descs, from the loaders' `desc=` in
# vllm/model_executor/model_loader/weight_utils.py (the bitsandbytes and sharded-state loaders read through them).
# Runai and InstantTensor count tensors, the others files; either way the fraction is the weights'.
WEIGHT_BARS = ("Loading safetensors checkpoint shards",  # default; " (eager)" after it with that load strategy
               "Loading safetensors using Fastsafetensor loader",  # --load-format fastsafetensors
               "Loading safetensors using InstantTensor loader",  # --load-format instanttensor
               "Loading safetensors using Runai Model Streamer",  # --load-format runai_streamer(_sharded)
               "Loading pt checkpoint shards", "Loading np_cache checkpoint shards",
               "Multi-thread loading pt checkpoint shards", "Multi-thread loading shards")  # enable_multithread_load
WEIGHTS_BAR_RE = re.compile(r"(?:^|[\s)])(?:" + "|".join(map(re.escape, WEIGHT_BARS))
                            + r")(?: \(eager\))?:\s*(\d+)% Completed \|\s*(\d+)/(\d+)")
# "Loading weights took 0.01 seconds" (CPU and GPU); "Model loading took 15.2 GiB memory and 11.3 seconds" (GPU).
_WEIGHTS_DONE_RE = re.compile(r"Loading weights took ([\d.]+) s|Model loading took .*? and ([\d.]+) s")
_INIT_DONE_RE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
# Checked against vLLM 0.32's own log calls; torch.compile runs inside the profiling run on GPUs.
_PATTERNS = [
    (re.compile(r"Starting vLLM (?:API )?server|Application startup complete"), "server_up"),
    (re.compile(r"Capturing CUDA graph|Graph capturing finished|CUDA graph pool memory"), "graph_capture"),
    (re.compile(r"Memory profiling takes|Initial profiling/warmup run took|Dynamo bytecode transform"
                r"|Compiling a graph for|torch\.compile t(?:akes|ook)|Profiling CUDA graph memory"
                r"|Estimated CUDA graph memory|Available KV cache memory|KV cache size:"
                r"|Maximum concurrency for"), "profiling_kv_cache"),
    (re.compile(r"Starting to load model"), "loading_weights"),
]
# The process names vLLM puts before a line: "(Worker_TP3 pid=7) " (before 0.10: "(VllmWorker rank=3 pid=7) "), and
# where the engine core relays its workers' output, both: "(EngineCore_DP0 pid=5) (Worker_TP0 pid=7) ".
PROCESS_PREFIX = r"(?:\((?:[^()\s]+ )+pid=\d+\)\s+)*"
# "(EngineCore pid=5) ERROR 11-29 13:27:56 [core.py:1512] message"; tracebacks come bare.
_LOG_PREFIX_RE = re.compile(r"^" + PROCESS_PREFIX + r"(?:(?P<level>[A-Z]+) \d\d-\d\d [\d:]+ \[[^\]]*\]\s+)?")
_ERROR_RE = re.compile(r"^(?:[\w.]*(?:Error|Exception)\b|CUDA out of memory|Engine core initialization failed"
                       r"|EngineCore failed to start|Worker proc .* died unexpectedly|.*Address already in use)")


@dataclass
class LoadProgress:
    """Follows an engine log to say which loading phase it is in and how far along."""

    phase: str = "starting"
    shards_done: int = 0
    shards_total: int = 0
    shard_percent: int = 0
    weights_seconds: float | None = None
    init_seconds: float | None = None
    error: str | None = None
    last_activity: float = field(default_factory=time.monotonic)
    _first_shard: tuple[float, int] | None = field(default=None, repr=False)
    _last_shard: tuple[float, int] | None = field(default=None, repr=False)

    def feed(self, line: str, now: float | None = None) -> None:
        """Take one log line (tqdm's \\r-separated updates included) and update the state."""
        now = time.monotonic() if now is None else now
        self.last_activity = now
        for part in line.split("\r"):
            self._feed_one(part, now)

    def _advance(self, phase: str) -> None:
        if PHASES.index(phase) > PHASES.index(self.phase):
            self.phase = phase

    def _feed_one(self, text: str, now: float) -> None:
        if m := WEIGHTS_BAR_RE.search(text):
            percent, done, total = map(int, m.groups())
            if self._last_shard is not None and (total != self.shards_total or done < self._last_shard[1]):
                self._first_shard = None  # another bar (a draft model's weights): its own rate
            self.shard_percent, self.shards_done, self.shards_total = percent, done, total
            if self._first_shard is None:
                self._first_shard = (now, self.shards_done)
            self._last_shard = (now, self.shards_done)
            self._advance("loading_weights")
            return
        if m := _WEIGHTS_DONE_RE.search(text):
            self.weights_seconds = float(m.group(1) or m.group(2))
            self._advance("weights_loaded")
            return
        if m := _INIT_DONE_RE.search(text):
            self.init_seconds = float(m.group(1))
            self._advance("graph_capture")
            return
        for pattern, phase in _PATTERNS:
            if pattern.search(text):
                self._advance(phase)
                return
        prefix = _LOG_PREFIX_RE.match(text)
        message = text[prefix.end() :].strip()
        # The first error is the cause; the ones after it are the engine going down.
        if self.error is None and prefix["level"] in (None, "ERROR", "CRITICAL") and _ERROR_RE.match(message):
            self.error = message

    @property
    def percent(self) -> int:
        """Overall load progress, 0..100."""
        if self.phase == "loading_weights":
            return 5 + (55 * self.shard_percent) // 100
        if self.init_seconds is not None and self.phase != "server_up":
            return 95  # engine ready, API server still starting
        return _PHASE_PERCENT[self.phase]

    @property
    def seconds_left(self) -> float | None:
        """Time left for the weights, from the shard rate so far; None when unknown."""
        if self.phase != "loading_weights" or not (self._first_shard and self._last_shard):
            return None
        (t0, n0), (t1, n1) = self._first_shard, self._last_shard
        if n1 <= n0 or t1 <= t0:
            return None
        return (self.shards_total - n1) * (t1 - t0) / (n1 - n0)

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since the last log line."""
        return (time.monotonic() if now is None else now) - self.last_activity

    def stalled(self, now: float, memory_moved_at: float, limit: float) -> float | None:
        """A load is stalled when neither its log nor its GPU memory (last moved at `memory_moved_at`) moved for more
        than `limit` seconds: how long, or None while it moves. A loader without a progress bar (sharded_state) is
        silent while it reads; the memory it fills keeps it alive."""
        idle = min(self.idle_s(now), now - memory_moved_at)
        return idle if idle > limit else None


def read_lines(log_path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines written after byte `offset`, and the offset to read from next time."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    # Keep a partial last line for the next call; tqdm ends its updates with \r, not \n.
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    text = data[:end].decode("utf-8", errors="replace")
    return [ln for ln in text.split("\n") if ln], offset + end


def tail(log_path: Path, n: int = 50) -> list[str]:
    """The last `n` lines of a log file ([] if it does not exist)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos, data = f.tell(), b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:]
