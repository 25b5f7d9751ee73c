"""The node agent's worker pool: threads in three lanes, so that work controlling engines never waits for
a thread behind downloads and benchmarks (a Stop always happens).

Celery gives a worker one pool and its consumer one prefetch window for all its queues: with every
thread downloading, a halt waited in Redis until the re-drive's bound (12 s) ran it. Here the agent's
worker takes every message of its queues as it arrives (prefetch unlimited, set by nodeagent: the
queues are this node's alone) and runs each on the lane of its task (plumbing/queue.py `lane`):
- `control`: halts and forgets (short; LANE_THREADS),
- `plans`: plans, follows, worker ranks' launches, persist (a plan holds its thread while the engine
  loads; LANE_THREADS, about one per engine a node loads at once),
- `host`: downloads, benchmarks and the rest, on the worker's own `--concurrency` threads.
What waits, waits in its lane inside the agent: received, so the re-drive knows it is in hand and late,
not lost; on a warm shutdown it is given back to Redis unacked, as before.
"""
from concurrent.futures import ThreadPoolExecutor

from celery.concurrency import thread
from celery.concurrency.base import apply_target

from plumbing import queue

LANE_THREADS = {queue.CONTROL: 2, queue.PLANS: 8}  # nodeagent's --control-threads and --plan-threads


class TaskPool(thread.TaskPool):
    """Celery's thread pool with a ThreadPoolExecutor per engine lane next to its own (the host lane)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lanes = {name: ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"lane-{name}")
                      for name, n in LANE_THREADS.items()}

    def executor_for(self, task_name: str) -> ThreadPoolExecutor:
        return self.lanes.get(queue.lane(task_name), self.executor)

    def on_apply(self, target, args=None, kwargs=None, callback=None, accept_callback=None, **_):
        # A worker request's args start with its task's name (celery.worker.request.Request.execute_using_pool).
        name = args[0] if args and isinstance(args[0], str) else ""
        return thread.ApplyResult(self.executor_for(name).submit(apply_target, target, args, kwargs,
                                                                 callback, accept_callback))

    def on_stop(self) -> None:
        for lane in self.lanes.values():  # cancel what waits in every lane at once, then wait for what runs
            lane.shutdown(wait=False, cancel_futures=True)
        super().on_stop()
        for lane in self.lanes.values():
            lane.shutdown(wait=True)

    def _get_info(self) -> dict:
        info = super()._get_info()
        info["lanes"] = {name: {"max-concurrency": lane._max_workers, "threads": len(lane._threads)}
                         for name, lane in self.lanes.items()}
        return info
