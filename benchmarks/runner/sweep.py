"""Runs levels across measuring processes; this process only coordinates, scrapes and calls back.

Each worker process has its own event loop, a share of the concurrency (its own semaphore) and
of the requests; all wait on one barrier so they start together, and every timestamp is
time.perf_counter(), i.e. CLOCK_MONOTONIC, one clock for every process on a Linux host.
Callbacks run here, never on a measuring loop, so a slow callback can't distort the numbers.
Workers are started with "spawn" (safe from threaded callers such as Celery): a script calling
sweep() needs the usual `if __name__ == "__main__":` guard. Where this process may not have
children (a daemonic pool worker), one thread measures instead, sharing this process's GIL.
Each worker makes its own share of the prompts (prompts.share_requests): the coordinator never holds
them, and a worker holds at most PREFETCH_BYTES of them ahead of the level's start (all of them for an
ordinary level, so no prompt is built while requests are timed), the rest as they are sent.
"""
import dataclasses
import math
import os
import pickle
import queue
import threading
import time

from deployments.host import vllm

import benchmarks.runner.capacity as capacity_search  # the modules, not the package (its __init__ imports this one)
import benchmarks.runner.workloads as workloads
from .arrivals import due_offsets, with_warmup
from .prompts import Target
from .saturation import representatives, saturated
from .metricsampler import Sampler
from .slo import evaluate as slo_evaluate
from .spec import LevelResult, LoadSpec, RunnerError, SweepResult, Tick, repeats_problem, timeout_problem
from .stats import request_samples, schedule_figures, summarize
from .tokens import WORDS_ONLY, PromptLengths, prompt_lengths
from .workers import BARRIER_TIMEOUT_S, POLL_S, Workers, _Command

STREAMS_PER_WORKER = 256  # auto mode: one more process per this many streams
CANCEL_CHECK_S = 0.2  # the caller's cancel check may be a database query: not more often
START_MARGIN_S = 0.05  # a rate level's time zero, after the barrier: every worker is on its loop by then
UNCAPPED = 1 << 30  # a rate level without max_concurrency: no slot is ever waited for
TIMED_OUT = ("they timed out (a run may set a longer request timeout: the form's, the API's request_timeout_s, "
             "panelctl bench --request-timeout)")


def auto_workers(concurrency: int) -> int:
    """One process per 256 streams, leaving a core free: the server (or vLLM's API server) may share
    the host, and on 2 cores a second worker measured worse (8 % TTFT error at 1024 vs 1-2 %)."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores - 1, math.ceil(concurrency / STREAMS_PER_WORKER)))


def _as_check(cancel):
    """A callable saying whether to stop, from None, a callable or anything with is_set()."""
    if cancel is None:
        return lambda: False
    if hasattr(cancel, "is_set"):
        return cancel.is_set
    return cancel


class Sweeper:
    """Runs levels one after another with the same workers and keep-alive connections."""

    def __init__(self, spec: LoadSpec, max_concurrency: int, memory_bytes: int = 0):
        """`memory_bytes` caps each measuring process (memory.limit); 0 leaves them as they are."""
        self.spec = spec
        self.target = Target(spec)
        self.workers = Workers(spec, spec.workers or auto_workers(max_concurrency), memory_bytes)
        self.snapshots = {wid: (0, 0, 0, 0, 0, 0) for wid in range(self.workers.count)}
        self.lengths = None

    def prompt_lengths(self) -> PromptLengths:
        """Word costs in the served model's tokens, measured once (random prompts only)."""
        if self.lengths is None:
            self.lengths = prompt_lengths(self.spec, self.target.root_url) if _made_up(self.spec) else PromptLengths(WORDS_ONLY)
        return self.lengths

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.workers.close()

    def run_level(self, concurrency: int, on_tick=None, cancel=None, repeat: int = 0) -> LevelResult:
        """Measure one concurrency level; on cancel, returns what finished, with cancelled=True. A repeat of the
        level sends prompts of its own (a prefix cache must not serve it from the repeat before)."""
        spec, workers = self.spec, self.workers
        warmup = spec.num_warmup(concurrency)
        total = warmup + spec.num_requests(concurrency)
        turns = spec.workload["turns"] if workloads.kind(spec) == "multiturn" else 0
        if turns:
            total, warmup = workloads.level_requests(spec, concurrency)
        lengths = self._lengths()
        active = min(workers.count, spec.workers or auto_workers(concurrency), concurrency)
        shares = [concurrency // active + (wid < concurrency % active) if wid < active else 0
                  for wid in range(workers.count)]
        for wid, slots in enumerate(_slots(shares)):
            workers.commands[wid].put(_Command(shares[wid], concurrency, total, warmup, slots, lengths, spec.tick_s,
                                               key=f"{concurrency}/{repeat}" if repeat else None, turns=turns))
        records, result = self._measure(concurrency, 0.0, on_tick, cancel, warmup, active)
        result.repeat = repeat
        result.prefix_reuse = workloads.reuse(spec, records)
        return result

    def run_rate(self, rate: float, on_tick=None, cancel=None, repeat: int = 0) -> LevelResult:
        """Measure one open-loop level: requests sent at their seeded due times (arrivals.py), at most
        spec.max_concurrency in flight (the rest wait for a slot, and the wait is recorded), after a
        warm-up of arrivals.rate_warmup requests that are not counted. A multi-turn workload's arrivals are
        its conversations' first turns (its later turns follow their think times). A repeat of the same
        rate (spec.repeats, or a capacity search's) draws its arrivals and its prompts from another seed."""
        spec, workers = self.spec, self.workers
        cap = spec.max_concurrency
        turns = spec.workload["turns"] if workloads.kind(spec) == "multiturn" else 0
        drawn = dataclasses.replace(spec, seed=spec.seed + 7919 * repeat) if repeat else spec
        if turns:
            arrivals_n, warmup = workloads.rate_conversations(spec, rate)
        else:
            arrivals_n, warmup = workloads.rate_level_requests(spec, rate)
        if workloads.kind(spec) == "trace":  # the trace's own arrivals, time-scaled to the rate, warm-up first
            due = workloads.trace_due(spec.workload, rate, warmup + arrivals_n)
        else:
            due = with_warmup(drawn, rate, due_offsets(drawn, rate, arrivals_n), warmup)
        total, warmup = (arrivals_n + warmup) * max(1, turns), warmup * max(1, turns)
        lengths = self._lengths()
        active = min(workers.count, spec.workers or auto_workers(cap or 1), cap or workers.count)
        for wid in range(workers.count):
            mine = wid < active
            share = (cap // active + (wid < cap % active) if cap else UNCAPPED) if mine else 0
            workers.commands[wid].put(_Command(share, active, total, warmup, [wid] if mine else [], lengths,
                                               spec.tick_s, due=due if mine else None,
                                               key=f"rate{rate:g}" + (f"/{repeat}" if repeat else ""),
                                               turns=turns))
        records, result = self._measure(cap, rate, on_tick, cancel, warmup, active)
        result.kind, result.rate, result.max_concurrency, result.repeat = "rate", rate, cap, repeat
        for name, value in schedule_figures(records).items():
            setattr(result, name, value)
        result.prefix_reuse = workloads.reuse(spec, records)
        return result

    def _lengths(self):
        """Word costs for prompts made up here (random ones, or a workload's), else None."""
        return self.prompt_lengths().costed() if _made_up(self.spec) else None

    def _measure(self, concurrency, rate, on_tick, cancel, warmup, active):
        """Start the workers' commands together, follow them to the end; (records, LevelResult)."""
        spec, workers, cancelled = self.spec, self.workers, _as_check(cancel)
        metrics_url = spec.metrics_url or vllm.metrics_url(self.target.root_url)
        sampler = Sampler(metrics_url, interval_s=spec.tick_s, key=spec.api_key) if spec.scrape_metrics else None
        if sampler:
            sampler.__enter__()
        try:
            self._wait_ready()
            workers.start.value = time.perf_counter() + START_MARGIN_S  # read by the workers once they pass
            workers.barrier.wait(BARRIER_TIMEOUT_S)
            records, was_cancelled, peak = self._collect((concurrency, rate), on_tick, cancelled, sampler)
        except threading.BrokenBarrierError:
            raise RunnerError("measuring workers did not start in time") from None
        except BaseException:
            workers.cancel.set()  # a failing callback, Ctrl-C, ...: stop the requests in flight too
            raise
        finally:
            if sampler:
                sampler.__exit__(None, None, None)
        workers.cancel.clear()
        records.sort(key=lambda r: r.index)
        result = summarize(concurrency, records, warmup=warmup, workers=active, cancelled=was_cancelled)
        result.peak_tok_s = peak
        if spec.prompt_source == "random" and not workloads.kind(spec):
            result.prompt_tokens_requested = spec.input_tokens
            result.prompt_tokens_counted_by = self.prompt_lengths().source
        if sampler:
            result.server_metrics = sampler.summary()
        result.samples = request_samples(records)
        return records, result

    def _wait_ready(self):
        """Until every worker has its first requests made: one that fails or dies meanwhile (out of
        memory, say) is reported now, not as a barrier timeout two minutes later."""
        workers, ready = self.workers, set()
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while len(ready) < workers.count and time.monotonic() < deadline:
            try:
                message = workers.results.get(timeout=POLL_S)
            except queue.Empty:
                workers.check_alive()
                continue
            if message[0] == "ready":
                ready.add(message[1])
            elif message[0] == "error":
                workers.cancel.set()
                raise RunnerError(f"measuring worker {message[1]} failed:\n{message[2]}")
            elif message[0] == "tick":
                self.snapshots[message[1]] = message[2]

    def _collect(self, level, on_tick, cancelled, sampler):
        workers, spec = self.workers, self.spec
        start = time.perf_counter()
        baseline = dict(self.snapshots)
        previous, last_tick = self._totals(), start
        records, done, was_cancelled, peak, next_check = [], set(), False, 0.0, start
        while len(done) < workers.count:
            try:
                message = workers.results.get(timeout=POLL_S)
            except queue.Empty:
                message = None
            if message is not None:
                kind, wid = message[0], message[1]
                if kind == "tick":
                    self.snapshots[wid] = message[2]
                elif kind == "done":
                    records.extend(pickle.loads(message[2]))
                    was_cancelled = was_cancelled or message[3]
                    done.add(wid)
                else:
                    workers.cancel.set()
                    raise RunnerError(f"measuring worker {wid} failed:\n{message[2]}")
            now = time.perf_counter()
            if now >= next_check and not workers.cancel.is_set():
                next_check = now + CANCEL_CHECK_S
                if cancelled():
                    workers.cancel.set()
            if now - last_tick >= spec.tick_s:
                totals = self._totals()
                tick = self._tick(level, now - start, now - last_tick, previous, totals, baseline, sampler)
                peak = max(peak, tick.tok_s)
                previous, last_tick = totals, now
                if on_tick is not None:
                    on_tick(tick)
            if message is None:
                workers.check_alive()
        return records, was_cancelled or workers.cancel.is_set(), peak

    def _totals(self):
        return tuple(sum(s[i] for s in self.snapshots.values()) for i in range(6))

    def _tick(self, level, elapsed, window, previous, totals, baseline, sampler) -> Tick:
        chunks = totals[0] - previous[0]
        tokens_per_chunk = totals[1] / totals[2] if totals[2] else 1.0
        base = tuple(sum(s[i] for s in baseline.values()) for i in range(6))
        return Tick(concurrency=level[0], rate=level[1], elapsed_s=elapsed, tok_s=chunks * tokens_per_chunk / window,
                    chunks_s=chunks / window, in_flight=totals[5], completed=totals[3] - base[3],
                    failed=totals[4] - base[4], server=sampler.latest() if sampler else None)


def _made_up(spec: LoadSpec) -> bool:
    """Whether the spec's prompts are made up here (random ones, or a workload's) and need word costs."""
    return (spec.prompt_source == "random" and not workloads.kind(spec)) or workloads.kind(spec) in workloads.GENERATED


def _slots(shares: list[int]) -> list[list[int]]:
    """Requests follow the concurrency shares: request i goes to the owner of slot i % concurrency,
    so each worker's first requests (the warmup) fill exactly its own slots. Slots interleave the
    workers in proportion to their shares; returns each worker's slots."""
    owners = [wid for _, wid in sorted((slot / share, wid) for wid, share in enumerate(shares)
                                       for slot in range(share))]
    mine = [[] for _ in shares]
    for slot, wid in enumerate(owners):
        mine[wid].append(slot)
    return mine


def run_level(spec: LoadSpec, concurrency: int, on_tick=None, cancel=None) -> LevelResult:
    """Measure one concurrency level (warmup first, excluded); see LoadSpec for the request counts."""
    with Sweeper(spec, concurrency) as sweeper:
        return sweeper.run_level(concurrency, on_tick=on_tick, cancel=cancel)


def run_rate(spec: LoadSpec, rate: float, on_tick=None, cancel=None) -> LevelResult:
    """Measure one open-loop level of `rate` requests/s (see Sweeper.run_rate)."""
    with Sweeper(spec, spec.max_concurrency or 1) as sweeper:
        return sweeper.run_rate(rate, on_tick=on_tick, cancel=cancel)


def length_problem(spec: LoadSpec, max_model_len: int | None) -> str:
    """Why the spec's requests cannot fit the served model's max_model_len ("" if they can): vLLM
    refuses a request whose prompt and max_tokens together exceed it."""
    if not max_model_len:
        return ""
    outputs = [spec.max_tokens] + [e["max_tokens"] for e in spec.prompts if "max_tokens" in e]
    if problem := workloads.length_problem(spec, max_model_len):
        return problem
    if spec.prompt_source == "random" and spec.input_tokens + spec.max_tokens > max_model_len:
        return (f"input_tokens + max_tokens = {spec.input_tokens} + {spec.max_tokens} = "
                f"{spec.input_tokens + spec.max_tokens}, more than the max model length {max_model_len}")
    if max(outputs) >= max_model_len:
        return f"max_tokens {max(outputs)} leaves no room for a prompt within the max model length {max_model_len}"
    return ""


def _check_lengths(spec: LoadSpec) -> None:
    """Refuse, before any request, a spec the server's max_model_len (GET /v1/models) cannot take."""
    root = Target(spec).root_url
    try:
        lengths = vllm.max_model_lengths(root, key=spec.api_key)
    except vllm.VllmError:
        return  # no such listing: the requests themselves will say
    if problem := length_problem(spec, lengths.get(spec.model)):
        raise RunnerError(f"{problem} of {spec.model} on the server (GET /v1/models).", permanent=True)


def sweep_workers(spec: LoadSpec) -> tuple[int, int]:
    """(the most streams any level of the spec runs at once, if known, its worker count)."""
    levels = [int(c) for c in spec.levels if int(c) > 0]
    top = max(levels + ([spec.max_concurrency or 1] if spec.rates or spec.capacity else []) or [1])
    return top, spec.workers or auto_workers(top)


def sweep(spec: LoadSpec, on_level=None, on_tick=None, cancel=None, memory_bytes: int = 0) -> SweepResult:
    """Measure every level of `spec.levels` in order, then every rate of `spec.rates`, then a capacity
    search when spec.capacity asks for one (result.capacity); stops early on cancel. Each level is
    scored against spec.slos (level.slo). Once the engine saturates the remaining concurrency levels are skipped unless
    spec.stop_when_saturated is off (then result.saturated says why); rate levels all run.

    on_level(LevelResult) after each level, on_tick(Tick) every spec.tick_s; both run in this
    process. `cancel` is a callable, or an asyncio/threading Event, checked between requests.
    `memory_bytes` caps each measuring process (child.py runs a whole sweep under a limit).
    Raises RunnerError when every request of a level failed (permanent for HTTP 4xx).
    """
    check = _as_check(cancel)
    result = SweepResult()
    levels = [int(c) for c in spec.levels if int(c) > 0]
    rates = [float(r) for r in spec.rates if float(r) > 0]
    if not levels and not rates and not spec.capacity:
        raise RunnerError("no concurrency levels or rates to run", permanent=True)
    if problem := timeout_problem(spec.request_timeout_s) or repeats_problem(spec.repeats):
        raise RunnerError(problem, permanent=True)
    if spec.capacity:
        capacity_search.check(spec.capacity)
        if not spec.slos:
            raise RunnerError("a capacity search needs SLOs to meet", permanent=True)
    _check_lengths(spec)

    def kept(level: LevelResult) -> LevelResult:
        level.slo = slo_evaluate(level.records, spec.slos, level.duration_s)
        result.levels.append(level)
        if on_level is not None:
            on_level(level)
        return level

    def failed(level: LevelResult, refused_only: bool = False) -> None:
        """Raise when every request of the level failed (only when the server refused them, 4xx, if refused_only:
        a capacity search's overloaded rate may fail whole and is then a miss)."""
        first = level.errors[0] if level.errors else TIMED_OUT if level.timeouts else "unknown error"
        if level.num_requests and not level.completed and (first.startswith("HTTP 4") or not refused_only):
            raise RunnerError(f"every request at {level.label} failed: {first}", permanent=first.startswith("HTTP 4"))

    def measured(level: LevelResult) -> bool:
        """Keep a level; False once the sweep must stop (cancelled)."""
        kept(level)
        if level.cancelled:
            result.cancelled = True
            return False
        failed(level)
        return True

    def probed(level: LevelResult) -> LevelResult:
        kept(level)
        failed(level, refused_only=True)
        return level

    def repeated(run) -> bool:
        """Each of the spec's repeats of a level (run(repeat) measures one); False once the sweep must stop."""
        for repeat in range(spec.repeats):
            if check():
                result.cancelled = True
                return False
            if not measured(run(repeat)):
                return False
        return True

    with Sweeper(spec, sweep_workers(spec)[0], memory_bytes) as sweeper:
        for concurrency in levels:
            if not repeated(lambda r: sweeper.run_level(concurrency, on_tick=on_tick, cancel=check, repeat=r)):
                break
            if spec.stop_when_saturated and concurrency != levels[-1]:
                result.saturated = saturated(representatives(result.levels))
                if result.saturated:
                    break
        for rate in rates if not result.cancelled else []:
            if not repeated(lambda r: sweeper.run_rate(rate, on_tick=on_tick, cancel=check, repeat=r)):
                break
        if spec.capacity and not result.cancelled:
            result.capacity = capacity_search.search(
                lambda rate, repeat: probed(sweeper.run_rate(rate, on_tick=on_tick, cancel=check, repeat=repeat)),
                spec.slos, spec.capacity, check)
            result.cancelled = result.cancelled or any(lv.cancelled for lv in result.levels)
    return result
