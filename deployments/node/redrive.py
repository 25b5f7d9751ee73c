"""Lost node work, re-driven from the database (a Stop always happens).

A halt, a plan or a benchmark run is a Celery message; the row saying it is owed is in the database.
The message can be lost after the row was written: Redis restarted empty (compose and the embedded
Redis keep nothing on disk), a web process died between its commit and `on_commit`, a worker lost
it. The agent's re-drive loop compares the rows with what this process is working on (`in_hand`, fed
by Celery's task signals) and, for a row owed work that nothing has picked up for REDRIVE_AFTER_S:

- a deployment or a worker rank of this node in Stopping: halted here and now, in a thread of this
  process (not through Redis: Redis may be why it was lost, and may still be away);
- a deployment Queued (its plan), or Starting/Loading with an engine and nothing following it, and what
  other apps register in agenthooks.REDRIVERS (benchmark runs Queued): sent again by name (queue.route
  picks the node's queue of its kind), only while its lane of the agent's worker has a free thread
  (plumbing/pool.py; the worker takes every message at once, so one waiting for a thread is received
  and in hand, but a thread free is the surer sign). A duplicate finds its row moved on and returns.
- a deployment Preparing, Stopping others, or Starting with no engine yet, whose plan nothing runs: the plan
  cannot go on from the middle, so it is failed here (its engine, if any, stopped; a redeploy starts afresh),
  as an agent restart does (reconcile.py), instead of staying mid-plan for ever.

The control-plane worker (queue `control`) re-drives its own work the same way (ControlRedriver, started
with that worker): benchmark runs against a URL, Queued and not in its hand.

Bound: a halt lost at time t runs by t + REDRIVE_AFTER_S + REDRIVE_EVERY_S (12 s; plus the halt itself).
The seconds a lost halt took are printed by `perf/fault_soak.py` (`lost_halt_s`; tests/faults/test_lost_halts.py
checks who stopped the engine, not how fast). A halt delivered runs at once on the control lane, whatever the
downloads hold.
Host work in hand is known per process, so the loop runs in the agent that consumes the node's queues.
"""
import collections
import logging
import os
import threading
import time

from celery import current_app, signals
from django.db import close_old_connections
from django.db.models import Q
from django.utils import timezone

from deployments import agenthooks
from deployments.models import Deployment, DeploymentEvent, DeploymentRank
from deployments.node.steps import fail
from deployments.timeline import deployment_event
from plumbing.queue import CONTROL, HOST, PLANS, lane, send_now

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


def tasks_in_hand(of_lane: str | None = None) -> int:
    """How many tasks from the queues run in this process now (of one lane, plumbing/queue.py), each
    holding a worker thread (a halt re-driven here runs on a thread of its own)."""
    with _lock:
        return sum(not str(task_id).startswith("here:") and of_lane in (None, lane(name))
                   for task_id, (name, _) in _running.items())


# --- the loop -------------------------------------------------------------------------------------

class Redriver:
    """One node's re-drive: `tick()` is one pass (tests call it), `loop()` repeats it."""

    def __init__(self, node_id: int, *, queue: str, slots: int | dict, after_s: float = REDRIVE_AFTER_S):
        self.node_id, self.queue, self.after_s = node_id, queue, after_s
        # The worker's threads by lane (plumbing/pool.py); one number: the same for each.
        self.slots = slots if isinstance(slots, dict) else dict.fromkeys((CONTROL, PLANS, HOST), slots)
        self._waiting: dict[tuple[str, object], float] = {}  # owed and not in hand since (monotonic)
        self._seen: set = set()
        self.counts: collections.Counter = collections.Counter()  # what was re-driven, by task name

    def due(self, name: str, pk, *also: str, now: float | None = None) -> bool:
        """Row `pk` is owed task `name` (or one of `also` would do): true once nothing has run it for
        the bound, then again a bound after each re-drive while the row still says it is owed."""
        now = time.monotonic() if now is None else now
        key = (name, pk)
        self._seen.add(key)
        if any(self.in_hand(n, pk) for n in (name, *also)):
            self._waiting[key] = now
            return False
        since = self._waiting.setdefault(key, now)
        if now - since < self.after_s:
            return False
        self._waiting[key] = now
        self.counts[name] += 1
        return True


    in_hand = staticmethod(in_hand)  # what this process holds (ControlRedriver reads its worker's state)

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
        # A thread of the lane idle: a message sent here would have been taken by now.
        if tasks_in_hand(PLANS) < self.slots[PLANS]:
            done += self._plans(now)
        if tasks_in_hand(HOST) < self.slots[HOST]:
            for drive in agenthooks.REDRIVERS:
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
        cut = Deployment.objects.filter(Q(status__in=(S.PREPARING, S.STOPPING_OTHERS)) | Q(status=S.STARTING, pid=None),
                                        node_id=self.node_id)
        for pk in cut.values_list("pk", flat=True):
            if self.due(PLAN, pk, FOLLOW, now=now):
                sent += self._here(PLAN, pk, self._fail_cut)
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
        log.warning("re-driving %s(%s): Stopping for %.0f s with no halt running (lost)", name, pk, self.after_s)
        return self._here(name, pk, self._run_halt)

    def _here(self, name: str, pk, work) -> int:
        """Run `work(name, pk)` in a thread of this process, marked in hand as task `name` so that the next
        pass waits for it."""
        _started(name, [pk])
        threading.Thread(target=self._run_here, args=(name, pk, work), name=f"redrive-{pk}", daemon=True).start()
        return 1

    def _run_here(self, name: str, pk, work) -> None:
        try:
            work(name, pk)
        except Exception:  # noqa: BLE001 - the row still says it is owed: re-driven again after the bound
            log.exception("re-driven %s(%s) failed", name, pk)
        finally:
            _ended(name, [pk])
            close_old_connections()

    def _run_halt(self, name: str, pk) -> None:
        self._note(name, pk)
        current_app.tasks[name].run(pk)  # the task's own function: the same code a queued halt runs

    def _fail_cut(self, name: str, pk) -> None:
        """A plan that stopped mid-way (its thread ended without failing the row, or its message was lost after
        it began): failed, engine stopped, as an agent restart would; a redeploy starts it afresh."""
        d = Deployment.objects.select_related("node", "model").get(pk=pk)
        if d.status in (S.PREPARING, S.STOPPING_OTHERS) or (d.status == S.STARTING and d.pid is None):
            log.warning("re-driving %s(%s): %s for %.0f s with no plan running", name, pk, d.status, self.after_s)
            fail(d, f"The deploy plan stopped while {d.get_status_display().lower()} and nothing ran it for "
                    f"{self.after_s:.0f} s; redeploy it.")

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



# --- the control-plane worker's own work ----------------------------------------------------------------

def _reserved() -> set:
    """What this process's Celery worker holds, received and not ended, whatever its pool: its consumer's own
    state (with the control worker's prefork pool the task signals fire in the children)."""
    from celery.worker import state

    return {_key(r.name, r.args) for r in list(state.reserved_requests)}


class ControlRedriver(Redriver):
    """The re-drive of the control queue's work (agenthooks.REDRIVERS called with no node: URL runs), in the
    control-plane worker, while it has a free slot (a message waiting behind busy slots is late, not lost)."""

    def __init__(self, *, queue: str, slots: int, after_s: float = REDRIVE_AFTER_S):
        super().__init__(None, queue=queue, slots=slots, after_s=after_s)

    @staticmethod
    def in_hand(name: str, pk) -> bool:
        return (name, pk) in _reserved()

    def tick(self, now: float | None = None) -> int:
        self._seen = set()
        done = 0
        if len(_reserved()) < self.slots[HOST]:
            for drive in agenthooks.REDRIVERS:
                done += drive(None, lambda name, pk: self.due(name, pk, now=now), self.send) or 0
        self._waiting = {k: v for k, v in self._waiting.items() if k in self._seen}
        return done


@signals.worker_ready.connect(weak=False, dispatch_uid="redrive-control-worker")
def _control_worker_ready(sender=None, **_):
    """Start the ControlRedriver in the worker that consumes the control queue (not in node agents)."""
    control = current_app.conf.task_default_queue
    if control not in set(current_app.amqp.queues.consume_from or ()):
        return
    slots = getattr(getattr(sender, "controller", None), "concurrency", None) or 1
    redriver = ControlRedriver(queue=control, slots=slots)
    threading.Thread(target=redriver.loop, args=(threading.Event(),), name="redrive-control", daemon=True).start()
    log.info("re-driving the %s queue's lost work every %.0f s (%d slots)", control, REDRIVE_EVERY_S, slots)
