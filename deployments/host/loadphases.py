"""Where an engine's start-up time goes: phases from launch to ready, parsed from its log, compared
with earlier loads and used to predict the next one. Plain Python, no Django.

Phases, in the order vLLM runs them on a GPU (the CPU build skips P2P, compile and graph capture):
process start -> P2P check -> weights -> torch.compile (inside the profiling run) -> KV-cache
profile/allocation -> CUDA-graph capture -> API up -> smoke test.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

from deployments.host.processlog import PROCESS_PREFIX, WEIGHTS_BAR_RE

PHASES = ("process", "p2p_check", "weights", "compile", "kv_cache", "graph_capture", "api_up", "smoke_test")
LABELS = {"process": "process start", "p2p_check": "P2P check", "weights": "weights", "compile": "torch.compile",
          "kv_cache": "KV cache", "graph_capture": "CUDA graphs", "api_up": "API up", "smoke_test": "smoke test"}

# (pattern, phase). A pattern with a group is a line vLLM prints at the END of that work with its
# duration ("torch.compile took 25.3 s in total"): the phase is back-dated by that many seconds.
# Checked against vLLM 0.32's logger calls (all_reduce_utils, gpu_model_runner, compilation/*, mem_utils).
_MARKERS = [(re.compile(p), phase) for p, phase in (
    (r"generating GPU P2P access cache|reading GPU P2P access cache", "p2p_check"),
    (r"Starting to load model", "weights"),
    (r"Starting torch\.compile|Dynamo bytecode transform time: ([\d.]+) s|torch\.compile t(?:akes|ook) ([\d.]+) s"
     r"|Compiling a graph for|Directly load the compiled graph|Warming up model for the compilation", "compile"),
    (r"Memory profiling takes ([\d.]+) s|Initial profiling/warmup run took ([\d.]+) s|Available KV cache memory|KV cache size:"
     r"|Profiling CUDA graph memory", "kv_cache"),
    (r"Capturing CUDA graphs|Graph capturing finished in ([\d.]+) secs", "graph_capture"),
    (r"init engine \(profile, create kv cache, warmup model\) took|Starting vLLM (?:API )?server"
     r"|Application startup complete", "api_up"),
)]
# The weights are in once vLLM says so; what follows is the profiling run (compile lines, when
# compile runs, re-date their own start).
_WEIGHTS_DONE = re.compile(r"Loading weights took ([\d.]+) s|Model loading took .*? and ([\d.]+) s")
# "(Worker pid=7) INFO 12-01 03:39:18 [x.py:1] ..." -> month, day, time: for replaying a recorded log.
_STAMP = re.compile(r"^" + PROCESS_PREFIX + r"[A-Z]+ (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")


@dataclass
class PhaseClock:
    """Follows a load: feed log lines with seconds since launch; `segments` is its Gantt bar."""

    segments: list[list] = field(default_factory=lambda: [["process", 0.0, 0.0]])
    shards_done: int = 0
    shards_total: int = 0
    weights_s: float | None = None  # vLLM's own figure
    done: bool = False
    bar_start: tuple[float, int] | None = None  # (now, done) at the weights bar's first line: its rate's origin

    @property
    def phase(self) -> str:
        return self.segments[-1][0]

    def enter(self, phase: str, now: float, took: float | None = None) -> None:
        """Phase `phase` began at `now` (or `took` seconds before it); the current one ends there."""
        self.segments[-1][2] = max(self.segments[-1][2], now)
        if self.done:
            return
        if phase == self.phase:
            if took and len(self.segments) > 1:  # a total printed at the end may reach further back
                previous, current = self.segments[-2], self.segments[-1]
                start = max(previous[1], min(current[1], now - took))
                previous[2] = current[1] = start
            return
        current = self.segments[-1]
        start = max(current[1], now - took) if took else now
        current[2] = start
        if took and current[2] <= current[1] and len(self.segments) > 1:
            self.segments.pop()  # an empty span: the back-dated phase swallowed it
        self.segments.append([phase, start, now])

    def feed(self, line: str, now: float) -> None:
        """One log line (tqdm's \\r-separated updates included) read `now` seconds after launch."""
        for text in line.split("\r"):
            if m := WEIGHTS_BAR_RE.search(text):  # any loader's bar (processlog.WEIGHT_BARS)
                done, total = int(m[2]), int(m[3])
                if self.bar_start is None or done < self.shards_done or total != self.shards_total:
                    self.bar_start = (now, done)  # a bar's first line (a draft model's weights have their own)
                self.shards_done, self.shards_total = done, total
                self.enter("weights", now)
                continue
            if (m := _WEIGHTS_DONE.search(text)) and self.weights_s is None:  # GPUs print two such lines
                self.weights_s = float(m[1] or m[2])
                self.enter("weights", now, self.weights_s)
                self.enter("kv_cache", now)
                continue
            for pattern, phase in _MARKERS:
                if m := pattern.search(text):
                    took = next((float(g) for g in m.groups() if g), None)
                    self.enter(phase, now, took)
                    break
            else:
                self.segments[-1][2] = max(self.segments[-1][2], now)

    def finish(self, now: float) -> None:
        """The load ended (ready, or the smoke test done): close the last span."""
        self.segments[-1][2] = max(self.segments[-1][2], now)
        self.done = True

    def elapsed_in_phase(self, now: float) -> float:
        return max(0.0, now - self.segments[-1][1])

    def totals(self) -> dict[str, float]:
        """Seconds per phase (a phase seen twice counts both spans)."""
        out: dict[str, float] = {}
        for phase, start, end in self.segments:
            out[phase] = round(out.get(phase, 0.0) + max(0.0, end - start), 2)
        return out

    def as_data(self) -> dict:
        """What is stored with the load and sent to the page."""
        return {"segments": [[p, round(s, 2), round(e, 2)] for p, s, e in self.segments],
                "totals": self.totals(), "shards_done": self.shards_done, "shards_total": self.shards_total,
                "weights_s": self.weights_s}


def replay(lines: list[str]) -> PhaseClock:
    """A recorded log's phases, timed by its own timestamps (1 s resolution; tqdm lines take the last one)."""
    clock, first, last = PhaseClock(), None, 0.0
    for line in lines:
        if m := _STAMP.match(line):
            month, day, h, mi, s = map(int, m.groups())
            t = (((month * 31 + day) * 24 + h) * 60 + mi) * 60 + s
            first = t if first is None else first
            last = float(t - first)
        clock.feed(line, last)
    clock.finish(last)
    return clock


def human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def compare(totals: dict[str, float], previous: dict[str, float], threshold_s: float = 1.0) -> list[str]:
    """Phases that moved by more than `threshold_s` against the previous load, as sentences."""
    out = []
    for phase in PHASES:
        if phase in totals and phase in previous:
            delta = totals[phase] - previous[phase]
            if abs(delta) > threshold_s:
                out.append(f"{LABELS[phase]} {human(abs(delta))} {'slower' if delta > 0 else 'faster'} than last time")
    return out


@dataclass
class Prediction:
    """Time to ready from earlier loads: total, seconds left and percent done."""

    total_s: float
    seconds_left: float
    percent: float
    basis: str  # "same key, N loads" or "same model on another node, scaled by disk rate"


def expected(history: list[dict[str, float]], weights_scale: float = 1.0) -> dict[str, float]:
    """Median seconds per phase over earlier loads (totals), the weights scaled for another disk.
    The smoke test is not part of time to ready."""
    phases = {p for h in history for p in h} - {"smoke_test"}
    out = {p: statistics.median(h.get(p, 0.0) for h in history) for p in phases}
    if "weights" in out:
        out["weights"] *= weights_scale
    return out


def predict(clock: PhaseClock, now: float, history: list[dict[str, float]], basis: str,
            weights_scale: float = 1.0) -> Prediction | None:
    """Seconds left = what the current phase usually takes beyond its elapsed time (for the weights, the bar's
    rate since its first line: the model's initialisation before it is no weights time) plus the usual length of
    every phase not reached yet. None without history."""
    if not history:
        return None
    usual = expected(history, weights_scale)
    seen = {p for p, _, _ in clock.segments}
    current = clock.phase
    done_fraction = (clock.shards_done / clock.shards_total) if current == "weights" and clock.shards_total else None
    in_phase = clock.elapsed_in_phase(now)
    t0, done0 = clock.bar_start or (now, clock.shards_done)
    if done_fraction and clock.shards_done > done0 and now > t0:
        left_current = (now - t0) * (clock.shards_total - clock.shards_done) / (clock.shards_done - done0)
    elif done_fraction:
        left_current = in_phase * (1 - done_fraction) / done_fraction
    else:
        left_current = max(0.0, usual.get(current, 0.0) - in_phase)
    left = left_current + sum(seconds for p, seconds in usual.items() if p not in seen)
    total = now + left
    return Prediction(total_s=round(total, 1), seconds_left=round(left, 1),
                      percent=round(min(99.0, 100.0 * now / total) if total > 0 else 0.0, 1), basis=basis)
