"""Lost node work re-driven from the database (deployments/node/redrive.py) and engine control routed to
its own queue (plumbing/queue.py), one pass at a time with the broker replaced at send_now; the real
processes (the agent, Redis emptied, a web process killed) are tests/faults/test_lost_halts.py."""
import contextlib
from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from benchmarks import runqueue
from benchmarks.models import BenchmarkRun
from deployments import tasks
from deployments.models import Deployment, DeploymentRank
from deployments.node import redrive
from plumbing import queue
from tests.factories import BenchmarkRunFactory, DeploymentFactory, NodeFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status
AFTER = redrive.REDRIVE_AFTER_S


@pytest.fixture
def node():
    return NodeFactory(name="gpu-01")


@pytest.fixture
def redriver(node):
    return redrive.Redriver(node.pk, queue=node.queue, slots=2)


@pytest.fixture
def sent():
    with mock.patch("deployments.node.redrive.send_now", autospec=True) as send_now:
        yield send_now


@pytest.fixture
def halted():
    """The halt tasks' own functions, as the re-drive runs them (in a thread of the agent)."""
    with mock.patch.object(tasks.deployment_halt, "run", autospec=True) as halt, \
            mock.patch.object(tasks.rank_halt, "run", autospec=True) as rank_halt:
        yield halt, rank_halt


def _settle_threads():
    import threading

    for t in threading.enumerate():
        if t.name.startswith("redrive-"):
            t.join(5)



@contextlib.contextmanager
def _busy(tasks):
    """These (task name, first argument) running on the agent's worker threads for the block."""
    for name, pk in tasks:
        redrive._started(name, [pk], task_id=f"t-{pk}")
    try:
        yield
    finally:
        for name, pk in tasks:
            redrive._ended(name, [pk], task_id=f"t-{pk}")

def test_engine_control_goes_to_the_nodes_control_queue_and_never_expires_plans_to_its_plans_queue():
    assert queue.route("deployments.deployment_halt", {"queue": "node.gpu-01", "expires": 600}) == {
        "queue": "node.gpu-01.control"}
    assert queue.route("deployments.rank_halt", {"queue": "node.gpu-02"})["queue"] == "node.gpu-02.control"
    assert queue.route("deployments.deployment_run", {"queue": "node.gpu-01", "expires": 600, "countdown": 10}) == {
        "queue": "node.gpu-01.plans", "expires": 600, "countdown": 10}  # a plan keeps its expiry
    assert queue.route("deployments.rank_run", {"queue": "node.gpu-02"})["queue"] == "node.gpu-02.plans"
    # Downloads and benchmarks stay on the node's queue; the control plane's queue is left alone.
    assert queue.route("deployments.model_copy_download", {"queue": "node.gpu-01"}) == {"queue": "node.gpu-01"}
    assert queue.route("benchmarks.run_execute", {"queue": "node.gpu-01"}) == {"queue": "node.gpu-01"}
    assert queue.route("deployments.deployment_halt", {"queue": "node.gpu-01.control"}) == {"queue": "node.gpu-01.control"}
    assert queue.route("deployments.model_inspect", {}) == {}


def test_a_halt_sent_from_a_service_reaches_the_control_queue_after_commit(node, sent_tasks):
    from deployments.dispatch import node_enqueue

    node_enqueue(node, "deployments.deployment_halt", 7)
    assert not sent_tasks  # not before the commit
    halt = sent_tasks.commit().one("deployments.deployment_halt")
    assert (halt.args, halt.options) == ([7], {"queue": "node.gpu-01.control"})


def test_a_stopping_deployment_with_no_halt_running_is_halted_here_after_the_bound(node, redriver, halted, sent):
    d = DeploymentFactory(node=node, status=S.STOPPING)
    assert redriver.tick(now=100.0) == 0  # first seen: the halt may be on its way
    assert redriver.tick(now=100.0 + AFTER - 1) == 0
    assert redriver.tick(now=100.0 + AFTER) == 1
    _settle_threads()
    halted[0].assert_called_once_with(d.pk)
    sent.assert_not_called()  # run here, not through Redis
    assert redriver.counts == {redrive.HALT: 1}
    assert redriver.tick(now=100.0 + AFTER + 1) == 0  # a re-drive waits another bound before the next


def test_a_halt_in_hand_is_not_redriven_and_a_settled_row_is_forgotten(node, redriver, halted):
    d = DeploymentFactory(node=node, status=S.STOPPING)
    redrive._started(redrive.HALT, [d.pk])  # a halt from the control queue runs now
    try:
        assert redriver.tick(now=0.0) == redriver.tick(now=10 * AFTER) == 0
    finally:
        redrive._ended(redrive.HALT, [d.pk])
    assert redriver.tick(now=10 * AFTER + 1) == 0  # the bound counts from when it was last in hand
    Deployment.objects.filter(pk=d.pk).update(status=S.STOPPED)
    redriver.tick(now=11 * AFTER)
    assert not redriver._waiting
    halted[0].assert_not_called()


def test_a_stopping_rank_on_this_node_is_halted_here(node, redriver, halted):
    d = DeploymentFactory(status=S.STOPPING)
    rank = DeploymentRank.objects.create(deployment=d, node=node, rank=1, state=DeploymentRank.State.STOPPING)
    redriver.tick(now=0.0)
    redriver.tick(now=AFTER)
    _settle_threads()
    halted[1].assert_called_once_with(rank.pk)
    halted[0].assert_not_called()  # the head's deployment is another node's to halt


def test_a_lost_plan_is_sent_again_with_what_is_left_of_its_expiry_only_while_the_plan_lane_has_a_free_thread(
        node, redriver, sent):
    d = DeploymentFactory(node=node, status=S.QUEUED, expires_at=timezone.now() + timedelta(seconds=300))
    DeploymentFactory(node=node, status=S.QUEUED, expires_at=timezone.now() - timedelta(seconds=1), port=9001)
    redrive._started(redrive.HALT, [5])  # a halt re-driven here runs on a thread of its own: no matter
    with _busy([(redrive.PLAN, 98), (redrive.FOLLOW, 99)]):  # both plan threads are taken:
        assert redriver.tick(now=0.0) == redriver.tick(now=AFTER) == 0  # the plan waits behind them, it is not lost
    with _busy([("deployments.model_copy_download", 96), ("benchmarks.run_execute", 97)]):  # host threads, all:
        assert redriver.tick(now=AFTER + 1) == 0  # no matter to a plan, which has threads of its own
        assert redriver.tick(now=2 * AFTER + 1) == 1
    (name,), options = sent.call_args.args, sent.call_args.kwargs
    assert name == redrive.PLAN and options["args"] == [d.pk] and options["queue"] == "node.gpu-01"
    assert 290 < options["expires"] <= 300  # the expired one ends failed by the watch, never re-sent
    redrive._ended(redrive.HALT, [5])


def test_a_loading_engine_nothing_follows_is_followed_again(node, redriver, sent):
    d = DeploymentFactory(node=node, status=S.LOADING, pid=4242)
    DeploymentFactory(node=node, status=S.LOADING, pid=4343, port=9002)
    redrive._started(redrive.PLAN, [d.pk])  # its plan follows it: nothing to do for that one
    try:
        redriver.tick(now=0.0)
        redriver.tick(now=AFTER)
    finally:
        redrive._ended(redrive.PLAN, [d.pk])
    assert [c.args[0] for c in sent.call_args_list] == [redrive.FOLLOW]
    assert sent.call_args.kwargs["args"] != [d.pk]


def test_a_lost_run_is_sent_again_only_while_the_worker_has_a_free_thread_and_only_one_copy_runs_it(
        node, redriver, sent):
    d = DeploymentFactory(node=node, status=S.READY)
    run = BenchmarkRunFactory(deployment=d, status=BenchmarkRun.Status.QUEUED)
    with _busy([("deployments.model_copy_download", 1), ("benchmarks.run_execute", 2)]):  # both worker threads
        assert redriver.tick(now=0.0) == redriver.tick(now=AFTER) == 0
    redriver.tick(now=AFTER + 1)
    redriver.tick(now=2 * AFTER + 1)
    assert sent.call_args.args == (runqueue.RUN_EXECUTE,) and sent.call_args.kwargs["args"] == [run.pk]
    first, second = BenchmarkRun.objects.get(pk=run.pk), BenchmarkRun.objects.get(pk=run.pk)
    assert runqueue.run_claim(first) is True
    assert runqueue.run_claim(second) is False  # read Queued too, but the row moved: the duplicate returns
    assert BenchmarkRun.objects.get(pk=run.pk).status == BenchmarkRun.Status.RUNNING


def test_a_redrive_the_broker_refuses_is_tried_again_at_the_next_bound(node, redriver, sent):
    DeploymentFactory(node=node, status=S.QUEUED, expires_at=timezone.now() + timedelta(seconds=300))
    sent.side_effect = ConnectionError("Redis away")
    redriver.tick(now=0.0)
    assert redriver.tick(now=AFTER) == 0
    sent.side_effect = None
    assert redriver.tick(now=2 * AFTER) == 1


def test_a_plan_waiting_for_its_countdown_in_the_agent_is_not_sent_again(node, redriver, sent):
    """An auto-restart's plan waits out its backoff (countdown) in the worker: received, not running."""
    from types import SimpleNamespace

    from celery import signals

    d = DeploymentFactory(node=node, status=S.QUEUED, expires_at=timezone.now() + timedelta(seconds=900))
    signals.task_received.send(sender=None, request=SimpleNamespace(id="t-1", task_name=redrive.PLAN, args=[d.pk]))
    try:
        assert redriver.tick(now=0.0) == redriver.tick(now=5 * AFTER) == 0
    finally:
        signals.task_revoked.send(sender=None, request=SimpleNamespace(id="t-1"))  # (it expired, say)
    assert redriver.tick(now=5 * AFTER + 1) == 0  # from then on, a bound like any other
    assert redriver.tick(now=6 * AFTER + 1) == 1
    sent.assert_called_once()


@pytest.mark.django_db(transaction=True)  # the failure is recorded from a thread of its own
def test_a_plan_cut_off_mid_way_is_failed_after_the_bound_and_one_running_is_left_alone(node, redriver, sent):
    cut = DeploymentFactory(node=node, status=S.PREPARING)
    stopping_others = DeploymentFactory(node=node, status=S.STOPPING_OTHERS, port=9003)
    running = DeploymentFactory(node=node, status=S.STARTING, port=9004)  # its plan launches the engine now
    launched = DeploymentFactory(node=node, status=S.STARTING, pid=4545, port=9005)  # followed, not failed
    with _busy([(redrive.PLAN, running.pk)]):
        assert redriver.tick(now=0.0) == 0
        assert redriver.tick(now=AFTER) == 3  # two failed here, one follow sent
        _settle_threads()
    assert [c.kwargs["args"] for c in sent.call_args_list] == [[launched.pk]]
    after = {d.pk: Deployment.objects.get(pk=d.pk) for d in (cut, stopping_others, running, launched)}
    assert after[cut.pk].status == after[stopping_others.pk].status == S.FAILED
    assert "The deploy plan stopped while preparing and nothing ran it" in after[cut.pk].status_message
    assert after[running.pk].status == after[launched.pk].status == S.STARTING


def test_the_control_worker_resends_a_lost_url_run_only_while_it_has_a_free_slot(node, sent):
    url_run = BenchmarkRunFactory(deployment=None, base_url="http://10.0.0.5:8000", status=BenchmarkRun.Status.QUEUED)
    BenchmarkRunFactory(deployment=DeploymentFactory(node=node, status=S.READY),
                        status=BenchmarkRun.Status.QUEUED)  # the node agent's to re-drive
    control = redrive.ControlRedriver(queue="control", slots=2)
    held = set()
    with mock.patch.object(redrive, "_reserved", lambda: held):
        held.update({("benchmarks.run_execute", url_run.pk)})  # received by the worker: late, not lost
        assert control.tick(now=0.0) == control.tick(now=AFTER) == 0
        held.clear()
        held.update({("deployments.model_inspect", 1), ("benchmarks.run_execute", 0)})  # both slots taken
        assert control.tick(now=AFTER + 1) == control.tick(now=3 * AFTER) == 0
        held.clear()
        assert control.tick(now=3 * AFTER + 1) == 0
        assert control.tick(now=4 * AFTER + 1) == 1
    assert sent.call_args.args == (runqueue.RUN_EXECUTE,)
    assert sent.call_args.kwargs == {"args": [url_run.pk], "queue": "control"}


def test_the_control_worker_alone_starts_the_control_redrive():
    from types import SimpleNamespace

    started = []
    with mock.patch.object(redrive.threading, "Thread", lambda target, **kw: SimpleNamespace(
            start=lambda: started.append(target.__self__))):
        with mock.patch.object(redrive.current_app.amqp.queues, "_consume_from", {"node.gpu-01": None}):
            redrive._control_worker_ready(sender=SimpleNamespace(controller=SimpleNamespace(concurrency=3)))
        assert started == []
        with mock.patch.object(redrive.current_app.amqp.queues, "_consume_from", {"control": None}):
            redrive._control_worker_ready(sender=SimpleNamespace(controller=SimpleNamespace(concurrency=3)))
    assert [type(r) for r in started] == [redrive.ControlRedriver] and started[0].slots[queue.HOST] == 3
