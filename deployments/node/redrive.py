"""Lost node work, re-driven from the database (issue 26: a Stop always happens).

A halt, a plan or a benchmark run is a Celery message; the row saying it is owed is in the database.
The message can be lost after the row was written: Redis restarted empty (compose and the embedded
Redis keep nothing on disk), a web process died between its commit and `on_commit`, a worker lost
it. The agent's re-drive loop compares the rows with what this process is working on (`in_hand`, fed
by Celery's task signals) and, for a row owed work that nothing has picked up for REDRIVE_AFTER_S:

- a deployment or a worker rank of this node in Stopping: halted here and now, in a thread of this
  process (not through Redis: Redis may be why it was lost, and may still be away);
- a deployment Queued (its plan), or Starting/Loading with an engine and nothing following it, and what
  other apps register in drivers.REDRIVE_DRIVERS (benchmark runs Queued): sent again by name (queue.route
  picks the node's queue of its kind), only while the agent's worker has a free thread (a message waiting
  behind busy threads is late, not lost). A duplicate finds its row moved on and returns.

Bound: a halt lost at time t, or kept waiting for a worker thread, runs by t + REDRIVE_AFTER_S +
REDRIVE_EVERY_S (12 s; plus the halt itself). Measured: ~10-12 s (tests/faults/test_lost_halts.py).
Host work in hand is known per process, so the loop runs in the agent that consumes the node's queues.
"""
import collections
import logging
import os
import threading
import time

from celery import current_app, signals
from django.db import close_old_connections
from django.utils import timezone

from controlpanel.queue import send_now
from deployments import drivers
from deployments.models import Deployment, DeploymentEvent, DeploymentRank
from deployments.timeline import deployment_event

log = logging.getLogger(__name__)
REDRIVE_AFTER_S = float(os.environ.get("PANEL_REDRIVE_AFTER", "10"))  # nothing in hand this long: lost
REDRIVE_EVERY_S = 2.0
HALT, RANK_HALT = "deployments.deployment_halt", "deployments.rank_halt"
PLAN, FOLLOW = "deployments.deployment_run", "deployments.deployment_follow"
S = Deployment.Status

# --- what this process is working on ------------------------------------------------------------

_lock = threading.Lock()
_held: dict = {}  # task id -> (task name, first argument): received here (an ETA'd plan waits so) until it ends
_running: dict = {}  # task id -> (task name, first argument): running now, holding a thread
_finished: set = set()  # keys whose task ended since the last pass: a row owed it again is owed anew


def _key(name, args) -> tuple[str, object]:
    return (name, args[0] if args else None)


@signals.task_received.connect(weak=False, dispatch_uid="redrive-received")
def _received(request=None, **_):
    with _lock:
        _held[request.id] = _key(request.task_name, request.args)


@signals.task_prerun.connect(weak=False, dispatch_uid="redrive-started")
def _started(task=None, args=None, task_id=None, **_):
    """A task starts (from a signal), or a re-driven halt here (`task` a name, no id)."""
    key = _key(getattr(task, "name", task), args)
    with _lock:
        _running[task_id or f"here:{key}"] = key


@signals.task_postrun.connect(weak=False, dispatch_uid="redrive-ended")
def _ended(task=None, args=None, task_id=None, **_):
    key = _key(getattr(task, "name", task), args)
    with _lock:
        _running.pop(task_id or f"here:{key}", None)
        _held.pop(task_id, None)
        _finished.add(key)


@signals.task_revoked.connect(weak=False, dispatch_uid="redrive-revoked")
def _revoked(request=None, **_):
    with _lock:  # revoked or expired before it ran: no postrun comes
        if key := _held.pop(getattr(request, "id", None), None):
            _finished.add(key)


def in_hand(name: str, pk) -> bool:
    """Whether this process holds task `name` for `pk`: received (waiting for its time or a thread) or
    running, from a queue or re-driven here."""
    with _lock:
        return (name, pk) in _running.values() or (name, pk) in _held.values()


def tasks_in_hand() -> int:
    """How many tasks from the queues run in this process now, each holding a worker thread (a halt
    re-driven here runs on a thread of its own)."""
    with _lock:
        return sum(not str(task_id).startswith("here:") for task_id in _running)


# --- the loop -------------------------------------------------------------------------------------

class Redriver:
    """One node's re-drive: `tick()` is one pass (tests call it), `loop()` repeats it."""

    def __init__(self, node_id: int, *, queue: str, slots: int, after_s: float = REDRIVE_AFTER_S):
        self.node_id, self.queue, self.slots, self.after_s = node_id, queue, slots, after_s  # slots: worker threads
        self._waiting: dict[tuple[str, object], float] = {}  # owed and not in hand since (monotonic)
        self._seen: set = set()
        self.counts: collections.Counter = collections.Counter()  # what was re-driven, by task name

    def due(self, name: str, pk, *also: str, now: float | None = None) -> bool:
        """Row `pk` is owed task `name` (or one of `also` would do): true once nothing has run it for
        the bound, then again a bound after each re-drive while the row still says it is owed."""
        now = time.monotonic() if now is None else now
        key = (name, pk)
        self._seen.add(key)
        if any(in_hand(n, pk) for n in (name, *also)):
            self._waiting[key] = now
            return False
        since = self._waiting.setdefault(key, now)
        if now - since < self.after_s:
            return False
        self._waiting[key] = now
        self.counts[name] += 1
        return True


    def tick(self, now: float | None = None) -> int:
        """One pass: halt what is lost in Stopping, re-send lost plans, follows and runs; how many."""
        self._seen = set()
        with _lock:
            for key in _finished:
                self._waiting.pop(key, None)
            _finished.clear()
        done = 0
        for pk in Deployment.objects.filter(node_id=self.node_id, status=S.STOPPING).values_list("pk", flat=True):
            if self.due(HALT, pk, now=now):
                done += self._halt(HALT, pk)
        for pk in DeploymentRank.objects.filter(node_id=self.node_id, state=DeploymentRank.State.STOPPING
                                                ).values_list("pk", flat=True):
            if self.due(RANK_HALT, pk, now=now):
                done += self._halt(RANK_HALT, pk)
        if tasks_in_hand() < self.slots:  # a thread idle: a message sent here would have been taken by now
            done += self._plans(now)
            for drive in drivers.REDRIVE_DRIVERS:
                done += drive(self.node_id, lambda name, pk: self.due(name, pk, now=now), self.send) or 0
        self._waiting = {k: v for k, v in self._waiting.items() if k in self._seen}  # settled rows
        return done

    def _plans(self, now) -> int:
        sent = 0
        queued = Deployment.objects.filter(node_id=self.node_id, status=S.QUEUED, expires_at__gt=timezone.now())
        for pk, expires_at in queued.values_list("pk", "expires_at"):
            if self.due(PLAN, pk, now=now):
                left = max(1.0, (expires_at - timezone.now()).total_seconds())
                sent += self.send(PLAN, pk, expires=left, why="its plan was not running")
        loading = Deployment.objects.filter(node_id=self.node_id, status__in=(S.STARTING, S.LOADING)).exclude(pid=None)
        for pk in loading.values_list("pk", flat=True):
            if self.due(FOLLOW, pk, PLAN, now=now):
                sent += self.send(FOLLOW, pk, why="nothing was following its engine")
        return sent

    def send(self, name: str, pk, *, why: str, **options) -> int:
        """Send task `name` for `pk` again to this node (queue.route picks the queue of its kind); 0 when
        Redis refuses (tried next pass)."""
        try:
            send_now(name, args=[pk], queue=self.queue, **options)
        except Exception as exc:  # noqa: BLE001 - the broker away: the row still says it is owed
            log.warning("re-drive of %s(%s) not sent: %s", name, pk, exc)
            return 0
        log.warning("re-driving %s(%s): %s for %.0f s", name, pk, why, self.after_s)
        return 1

    def _halt(self, name: str, pk) -> int:
        """Run the halt in a thread of this process, marked in hand so that the next pass waits for it."""
        log.warning("re-driving %s(%s): Stopping for %.0f s with no halt running (lost)", name, pk, self.after_s)
        _started(name, [pk])
        threading.Thread(target=self._run_halt, args=(name, pk), name=f"redrive-{pk}", daemon=True).start()
        return 1

    def _run_halt(self, name: str, pk) -> None:
        try:
            self._note(name, pk)
            current_app.tasks[name].run(pk)  # the task's own function: the same code a queued halt runs
        except Exception:  # noqa: BLE001 - the row stays Stopping: re-driven again after the bound
            log.exception("re-driven %s(%s) failed", name, pk)
        finally:
            _ended(name, [pk])
            close_old_connections()

    def _note(self, name: str, pk) -> None:
        """Say on the deployment's timeline why it is stopped again (best effort: Redis may be away)."""
        why = f"no halt ran for {self.after_s:.0f} s (Redis emptied, or a web process died before sending it)"
        try:
            if name == HALT:
                deployment_event(Deployment.objects.get(pk=pk), "stop", f"The halt was lost: {why}; stopping again.",
                                 level=DeploymentEvent.Level.WARNING)
            else:
                r = DeploymentRank.objects.select_related("deployment", "node").get(pk=pk)
                deployment_event(r.deployment, f"stop@{r.node.name}", f"Rank {r.rank}'s halt was lost: {why}; "
                                 "stopping it again.", level=DeploymentEvent.Level.WARNING, node=r.node.name)
        except Exception as exc:  # noqa: BLE001 - the halt matters, not its line
            log.warning("re-drive of %s(%s): no timeline line: %s", name, pk, exc)

    def loop(self, stop: threading.Event, every_s: float = REDRIVE_EVERY_S) -> None:
        """Tick every `every_s` until stopped; a failing pass (the database away) is retried next time."""
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad pass
                log.exception("re-drive pass failed")
            finally:
                close_old_connections()
            stop.wait(every_s)

