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
import asyncio
import gc
import math
import multiprocessing
import itertools
import os
import pickle
import queue
import threading
import time
import traceback
from dataclasses import dataclass

from deployments.host import vllm

import benchmarks.runner.memory as memory  # the module, not the package: its __init__ imports this one
from .load import Pool, run_share
from .prompts import Target, share_requests
from .saturation import saturated
from .scrape import Sampler
from .spec import LevelResult, LoadSpec, RunnerError, SweepResult, Tick
from .stats import request_samples, summarize
from .stream import Counters
from .tokens import WORDS_ONLY, PromptLengths, prompt_lengths

STREAMS_PER_WORKER = 256  # auto mode: one more process per this many streams
BUSY_POLL_STREAMS = 256  # auto mode: a process with this many streams polls instead of sleeping
BARRIER_TIMEOUT_S = 120.0
POLL_S = 0.02
CANCEL_CHECK_S = 0.2  # the caller's cancel check may be a database query: not more often
PREFETCH_BYTES = 64 * 2**20  # request bytes a worker builds before a level starts (a quarter of its limit at most)


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
    concurrency: int  # this worker's share of the streams
    level: int  # the level's concurrency (request i belongs to the owner of slot i % level)
    total: int  # requests of the level, warmup included
    warmup: int
    slots: list  # the slots this worker owns
    lengths: object  # PromptLengths.costed() for random prompts, else None
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


def _prefetched(requests, budget: int) -> list:
    """The first requests of an iterator, up to `budget` bytes (at least one)."""
    out, size = [], 0
    for request in requests:
        out.append(request)
        size += len(request[2])
        if size >= budget:
            break
    return out


def _worker_main(wid, spec, commands, results, barrier, cancel_event, own_process=True, memory_bytes=0):
    """A measuring process (or thread): runs each level's share of requests on its own loop."""
    parent = os.getppid()
    prefetch = PREFETCH_BYTES
    if own_process:
        memory.limit(memory_bytes)
        prefetch = min(prefetch, memory.current() // 4 or prefetch)
        _raise_fd_limit()
        gc.disable()  # a collection pauses the loop and delays timestamps; collect between levels instead
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    failed = []

    def on_loop_error(loop, context):
        # A MemoryError in a protocol callback would only be logged, and its request hang until the
        # timeout: end the level instead, and say why.
        if isinstance(context.get("exception"), MemoryError):
            failed.append(context["exception"])
        loop.default_exception_handler(context)

    loop.set_exception_handler(on_loop_error)
    target = Target(spec)
    pool = Pool(target, spec.verify_tls, Counters())

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
                requests = share_requests(spec, target, command.lengths, command.level, command.total,
                                          command.warmup, command.slots)
                ahead = _prefetched(requests, prefetch)
                results.put(("ready", wid))
                barrier.wait(BARRIER_TIMEOUT_S)
                busy = spec.busy_poll if spec.busy_poll is not None else command.concurrency >= BUSY_POLL_STREAMS
                records, cancelled = loop.run_until_complete(run_share(
                    pool, itertools.chain(ahead, requests), command.concurrency, spec.request_timeout_s,
                    lambda: bool(failed) or cancel_event.is_set(), report, command.tick_s, busy))
                del ahead
                if failed:
                    raise failed.pop()
                # Pickled here, where a MemoryError is caught and reported; a Queue would pickle in its
                # feeder thread, which drops what it cannot send and leaves the coordinator waiting.
                results.put(("done", wid, pickle.dumps(records, pickle.HIGHEST_PROTOCOL), cancelled))
            except Exception:
                requests = records = ahead = None  # after a MemoryError: room to report it
                results.put(("error", wid, traceback.format_exc()))
            if own_process:
                gc.collect()
    finally:
        pool.close()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


class Workers:
    """The measuring processes of one sweep (threads when this process may not have children)."""

    def __init__(self, spec: LoadSpec, count: int, memory_bytes: int = 0):
        self.count, self.memory_bytes = count, memory_bytes
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
                             args=(wid, spec, self.commands[wid], self.results, self.barrier, self.cancel, processes,
                                   self.memory_bytes))
                        for wid in range(self.count)]
        for member in self.members:
            member.start()

    def check_alive(self):
        for member in self.members:
            if not member.is_alive():
                raise RunnerError(f"measuring worker {member.name} died (exit code {getattr(member, 'exitcode', '?')})"
                                  + (" at its memory limit" if self.memory_bytes else ""))

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
            self.lengths = (prompt_lengths(self.spec, self.target.root_url) if self.spec.prompt_source == "random"
                            else PromptLengths(WORDS_ONLY))
        return self.lengths

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.workers.close()

    def run_level(self, concurrency: int, on_tick=None, cancel=None) -> LevelResult:
        """Measure one concurrency level; on cancel, returns what finished, with cancelled=True."""
        spec, workers, cancelled = self.spec, self.workers, _as_check(cancel)
        warmup = spec.num_warmup(concurrency)
        total = warmup + spec.num_requests(concurrency)
        lengths = self.prompt_lengths().costed() if spec.prompt_source == "random" else None
        active = min(workers.count, spec.workers or auto_workers(concurrency), concurrency)
        shares = [concurrency // active + (wid < concurrency % active) if wid < active else 0
                  for wid in range(workers.count)]
        for wid, slots in enumerate(_slots(shares)):
            workers.commands[wid].put(_Command(shares[wid], concurrency, total, warmup, slots, lengths, spec.tick_s))
        metrics_url = spec.metrics_url or vllm.metrics_url(self.target.root_url)
        sampler = Sampler(metrics_url, interval_s=spec.tick_s, key=spec.api_key) if spec.scrape_metrics else None
        if sampler:
            sampler.__enter__()
        try:
            self._wait_ready()
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
        result.samples = request_samples(records)
        return result

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


def length_problem(spec: LoadSpec, max_model_len: int | None) -> str:
    """Why the spec's requests cannot fit the served model's max_model_len ("" if they can): vLLM
    refuses a request whose prompt and max_tokens together exceed it."""
    if not max_model_len:
        return ""
    outputs = [spec.max_tokens] + [e["max_tokens"] for e in spec.prompts if "max_tokens" in e]
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


def sweep(spec: LoadSpec, on_level=None, on_tick=None, cancel=None, memory_bytes: int = 0) -> SweepResult:
    """Measure every level of `spec.levels` in order; stops early on cancel, and once the engine
    saturates unless spec.stop_when_saturated is off (then result.saturated says why).

    on_level(LevelResult) after each level, on_tick(Tick) every spec.tick_s; both run in this
    process. `cancel` is a callable, or an asyncio/threading Event, checked between requests.
    `memory_bytes` caps each measuring process (child.py runs a whole sweep under a limit).
    Raises RunnerError when every request of a level failed (permanent for HTTP 4xx).
    """
    check = _as_check(cancel)
    result = SweepResult()
    levels = [int(c) for c in spec.levels if int(c) > 0]
    if not levels:
        raise RunnerError("no concurrency levels to run", permanent=True)
    _check_lengths(spec)
    with Sweeper(spec, max(levels), memory_bytes) as sweeper:
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
