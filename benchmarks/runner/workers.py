"""The measuring processes of a sweep: each runs its share of a level's requests on its own event loop.

Started with "spawn" (safe from threaded callers such as Celery); where this process may not have children
(a daemonic pool worker), one thread measures instead. Each worker makes its own share of the prompts
(prompts.share_requests) and holds at most PREFETCH_BYTES of them ahead of the level's start. A rate level's
requests are sent at their due times, counted from one start time every worker reads (Workers.start).
"""
import asyncio
import functools
import gc
import itertools
import multiprocessing
import os
import pickle
import queue
import threading
import time
import traceback
from dataclasses import dataclass

import benchmarks.runner.memory as memory  # the modules, not the package: its __init__ imports this one
import benchmarks.runner.workloads as workloads
from plumbing.eventloops import new_loop, raise_fd_limit
from .load import Pool, run_share
from .prompts import Target, share_requests
from .spec import LoadSpec, RunnerError
from .stream import Counters

BUSY_POLL_STREAMS = 256  # auto mode: a process with this many streams polls instead of sleeping
BARRIER_TIMEOUT_S = 120.0
POLL_S = 0.02
PREFETCH_BYTES = 64 * 2**20  # request bytes a worker builds before a level starts (a quarter of its limit at most)

@dataclass
class _Command:
    concurrency: int  # this worker's share of the streams
    level: int  # the level's concurrency (request i belongs to the owner of slot i % level)
    total: int  # requests of the level, warmup included
    warmup: int
    slots: list  # the slots this worker owns
    lengths: object  # PromptLengths.costed() for random prompts, else None
    tick_s: float
    due: list | None = None  # a rate level: each request's due time, in seconds from the shared start
    key: object = None  # what seeds the level's random prompts (default: its concurrency)
    turns: int = 0  # a multi-turn level: requests per conversation (load.run_share); with `due`, one per conversation


def _prefetched(requests, budget: int) -> list:
    """The first requests of an iterator, up to `budget` bytes (at least one)."""
    out, size = [], 0
    for request in requests:
        out.append(request)
        size += len(request.data)
        if size >= budget:
            break
    return out


def _worker_main(wid, spec, commands, results, barrier, cancel_event, own_process=True, memory_bytes=0, start=None):
    """A measuring process (or thread): runs each level's share of requests on its own loop."""
    parent = os.getppid()
    prefetch = PREFETCH_BYTES
    if own_process:
        memory.limit(memory_bytes)
        prefetch = min(prefetch, memory.current() // 4 or prefetch)
        raise_fd_limit()
        gc.disable()  # a collection pauses the loop and delays timestamps; collect between levels instead
    loop = new_loop()
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
                                          command.warmup, command.slots, key=command.key)
                ahead = _prefetched(requests, prefetch)
                results.put(("ready", wid))
                barrier.wait(BARRIER_TIMEOUT_S)
                busy = spec.busy_poll if spec.busy_poll is not None else command.concurrency >= BUSY_POLL_STREAMS
                records, cancelled = loop.run_until_complete(run_share(
                    pool, itertools.chain(ahead, requests), command.concurrency,
                    lambda: bool(failed) or cancel_event.is_set(), report, command.tick_s, busy,
                    due=command.due, start_at=start.value if command.due is not None else 0.0,
                    turns=command.turns, think=functools.partial(workloads.think_time, spec.workload)))
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
        # A rate level's time zero, set by the coordinator before it joins the barrier: due times are
        # counted from it in every worker alike.
        self.start = ctx.Value("d", 0.0, lock=False) if processes else _Value()
        kind = ctx.Process if processes else threading.Thread
        self.members = [kind(target=_worker_main, name=f"bench-worker-{wid}", daemon=True,
                             args=(wid, spec, self.commands[wid], self.results, self.barrier, self.cancel, processes,
                                   self.memory_bytes, self.start))
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


class _Value:
    """multiprocessing.Value's `.value`, for worker threads."""

    value = 0.0
