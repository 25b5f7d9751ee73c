"""Runs levels across measuring processes; this process only coordinates, scrapes and calls back.

Each worker process has its own event loop, a share of the concurrency (its own semaphore) and
of the requests; all wait on one barrier so they start together, and every timestamp is
time.perf_counter(), i.e. CLOCK_MONOTONIC, one clock for every process on a Linux host.
Callbacks run here, never on a measuring loop, so a slow callback can't distort the numbers.
Workers are started with "spawn" (safe from threaded callers such as Celery): a script calling
sweep() needs the usual `if __name__ == "__main__":` guard. Where this process may not have
children (a daemonic pool worker), one thread measures instead, sharing this process's GIL.
"""
import asyncio
import gc
import math
import multiprocessing
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass

from deployments.host import vllm

from .load import Pool, run_share
from .prompts import Target, prompt_entries, request_body
from .saturation import saturated
from .scrape import Sampler
from .spec import LevelResult, LoadSpec, RunnerError, SweepResult, Tick
from .stats import summarize
from .stream import Counters
from .tokens import WORDS_ONLY, PromptLengths, prompt_lengths

STREAMS_PER_WORKER = 256  # auto mode: one more process per this many streams
BUSY_POLL_STREAMS = 256  # auto mode: a process with this many streams polls instead of sleeping
BARRIER_TIMEOUT_S = 120.0
POLL_S = 0.02
CANCEL_CHECK_S = 0.2  # the caller's cancel check may be a database query: not more often


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


@dataclass
class _Command:
    concurrency: int
    requests: list  # [(index, warmup, request bytes)]
    tick_s: float


def _new_loop():  # tests/schedserver.py has its own copy: see there why
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _raise_fd_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _worker_main(wid, spec, commands, results, barrier, cancel_event, own_process=True):
    """A measuring process (or thread): runs each level's share of requests on its own loop."""
    parent = os.getppid()
    if own_process:
        _raise_fd_limit()
        gc.disable()  # a collection pauses the loop and delays timestamps; collect between levels instead
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    pool = Pool(Target(spec), spec.verify_tls, Counters())

    def report(c):
        results.put(("tick", wid, (c.chunks, c.tokens, c.token_chunks, c.completed, c.failed, c.in_flight)))

    try:
        while True:
            try:
                command = commands.get(timeout=1.0)
            except queue.Empty:
                if own_process and os.getppid() != parent:
                    return  # the coordinator died without saying goodbye
                continue
            if command is None:
                return
            try:
                barrier.wait(BARRIER_TIMEOUT_S)
                busy = spec.busy_poll if spec.busy_poll is not None else command.concurrency >= BUSY_POLL_STREAMS
                records, cancelled = loop.run_until_complete(run_share(
                    pool, command.requests, command.concurrency, spec.request_timeout_s,
                    cancel_event.is_set, report, command.tick_s, busy))
                results.put(("done", wid, records, cancelled))
            except Exception:
                results.put(("error", wid, traceback.format_exc()))
            if own_process:
                gc.collect()
    finally:
        pool.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


class Workers:
    """The measuring processes of one sweep (threads when this process may not have children)."""

    def __init__(self, spec: LoadSpec, count: int):
        self.count = count
        try:
            self._start(spec, multiprocessing.get_context("spawn"), processes=True)
        except AssertionError:  # "daemonic processes are not allowed to have children" (e.g. Celery prefork)
            self.count = 1
            self._start(spec, None, processes=False)

    def _start(self, spec, ctx, processes):
        make_queue = ctx.Queue if processes else queue.Queue
        self.commands = [make_queue() for _ in range(self.count)]
        self.results = make_queue()
        self.barrier = (ctx.Barrier if processes else threading.Barrier)(self.count + 1)
        self.cancel = (ctx.Event if processes else threading.Event)()
        kind = ctx.Process if processes else threading.Thread
        self.members = [kind(target=_worker_main, name=f"bench-worker-{wid}", daemon=True,
                             args=(wid, spec, self.commands[wid], self.results, self.barrier, self.cancel, processes))
                        for wid in range(self.count)]
        for member in self.members:
            member.start()

    def check_alive(self):
        for member in self.members:
            if not member.is_alive():
                raise RunnerError(f"measuring worker {member.name} died (exit code {getattr(member, 'exitcode', '?')})")

    def close(self):
        """Say goodbye; a worker still busy is given 10 s, then terminated."""
        for commands in self.commands:
            commands.put(None)
        deadline = time.monotonic() + 10
        while any(m.is_alive() for m in self.members) and time.monotonic() < deadline:
            try:  # a process exits only once what it queued has been read
                self.results.get(timeout=POLL_S)
            except queue.Empty:
                pass
        for member in self.members:
            if member.is_alive() and hasattr(member, "terminate"):
                member.terminate()
            member.join(5)


class Sweeper:
    """Runs levels one after another with the same workers and keep-alive connections."""

    def __init__(self, spec: LoadSpec, max_concurrency: int):
        self.spec = spec
        self.target = Target(spec)
        self.workers = Workers(spec, spec.workers or auto_workers(max_concurrency))
        self.snapshots = {wid: (0, 0, 0, 0, 0, 0) for wid in range(self.workers.count)}
        self.lengths = None

    def prompt_lengths(self) -> PromptLengths:
        """Word costs in the served model's tokens, measured once (random prompts only)."""
        if self.lengths is None:
            self.lengths = (prompt_lengths(self.spec, self.target.root_url) if self.spec.prompt_source == "random"
                            else PromptLengths(WORDS_ONLY))
        return self.lengths

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.workers.close()

    def _requests(self, concurrency: int) -> tuple[list, int]:
        warmup, measured = self.spec.num_warmup(concurrency), self.spec.num_requests(concurrency)
        cache = {}
        requests = []
        for index, entry in enumerate(prompt_entries(self.spec, warmup + measured, self.prompt_lengths())):
            data = cache.get(id(entry))
            if data is None:
                data = cache[id(entry)] = self.target.request_bytes(request_body(self.spec, entry))
            requests.append((index, index < warmup, data))
        return requests, warmup

    def run_level(self, concurrency: int, on_tick=None, cancel=None) -> LevelResult:
        """Measure one concurrency level; on cancel, returns what finished, with cancelled=True."""
        spec, workers, cancelled = self.spec, self.workers, _as_check(cancel)
        requests, warmup = self._requests(concurrency)
        active = min(workers.count, spec.workers or auto_workers(concurrency), concurrency)
        shares = [concurrency // active + (wid < concurrency % active) if wid < active else 0
                  for wid in range(workers.count)]
        for wid, part in enumerate(_split(requests, shares)):
            workers.commands[wid].put(_Command(shares[wid], part, spec.tick_s))
        metrics_url = spec.metrics_url or vllm.metrics_url(self.target.root_url)
        sampler = Sampler(metrics_url, interval_s=spec.tick_s) if spec.scrape_metrics else None
        if sampler:
            sampler.__enter__()
        try:
            workers.barrier.wait(BARRIER_TIMEOUT_S)
            records, was_cancelled, peak = self._collect(concurrency, on_tick, cancelled, sampler)
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
        if spec.prompt_source == "random":
            result.prompt_tokens_requested = spec.input_tokens
            result.prompt_tokens_counted_by = self.prompt_lengths().source
        if sampler:
            result.server_metrics = sampler.summary()
        return result

    def _collect(self, concurrency, on_tick, cancelled, sampler):
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
                    records.extend(message[2])
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
                tick = self._tick(concurrency, now - start, now - last_tick, previous, totals, baseline, sampler)
                peak = max(peak, tick.tok_s)
                previous, last_tick = totals, now
                if on_tick is not None:
                    on_tick(tick)
            if message is None:
                workers.check_alive()
        return records, was_cancelled or workers.cancel.is_set(), peak

    def _totals(self):
        return tuple(sum(s[i] for s in self.snapshots.values()) for i in range(6))

    def _tick(self, concurrency, elapsed, window, previous, totals, baseline, sampler) -> Tick:
        chunks = totals[0] - previous[0]
        tokens_per_chunk = totals[1] / totals[2] if totals[2] else 1.0
        base = tuple(sum(s[i] for s in baseline.values()) for i in range(6))
        return Tick(concurrency=concurrency, elapsed_s=elapsed, tok_s=chunks * tokens_per_chunk / window,
                    chunks_s=chunks / window, in_flight=totals[5], completed=totals[3] - base[3],
                    failed=totals[4] - base[4], server=sampler.latest() if sampler else None)


def _split(requests: list, shares: list[int]) -> list[list]:
    """Requests follow the concurrency shares: request i goes to the owner of slot i % concurrency,
    so each worker's first requests (the warmup) fill exactly its own slots."""
    owners = [wid for _, wid in sorted((slot / share, wid) for wid, share in enumerate(shares)
                                       for slot in range(share))]
    parts = [[] for _ in shares]
    for request in requests:
        parts[owners[request[0] % len(owners)]].append(request)
    return parts


def run_level(spec: LoadSpec, concurrency: int, on_tick=None, cancel=None) -> LevelResult:
    """Measure one concurrency level (warmup first, excluded); see LoadSpec for the request counts."""
    with Sweeper(spec, concurrency) as sweeper:
        return sweeper.run_level(concurrency, on_tick=on_tick, cancel=cancel)


def sweep(spec: LoadSpec, on_level=None, on_tick=None, cancel=None) -> SweepResult:
    """Measure every level of `spec.levels` in order; stops early on cancel, and once the engine
    saturates unless spec.stop_when_saturated is off (then result.saturated says why).

    on_level(LevelResult) after each level, on_tick(Tick) every spec.tick_s; both run in this
    process. `cancel` is a callable, or an asyncio/threading Event, checked between requests.
    Raises RunnerError when every request of a level failed (permanent for HTTP 4xx).
    """
    check = _as_check(cancel)
    result = SweepResult()
    levels = [int(c) for c in spec.levels if int(c) > 0]
    if not levels:
        raise RunnerError("no concurrency levels to run", permanent=True)
    with Sweeper(spec, max(levels)) as sweeper:
        for concurrency in levels:
            if check():
                result.cancelled = True
                break
            level = sweeper.run_level(concurrency, on_tick=on_tick, cancel=check)
            result.levels.append(level)
            if on_level is not None:
                on_level(level)
            if level.cancelled:
                result.cancelled = True
                break
            if level.num_requests and not level.completed:
                first = level.errors[0] if level.errors else "unknown error"
                raise RunnerError(f"every request at concurrency {concurrency} failed: {first}",
                                  permanent=first.startswith("HTTP 4"))
            if spec.stop_when_saturated and concurrency != levels[-1]:
                result.saturated = saturated(result.levels)
                if result.saturated:
                    break
    return result
