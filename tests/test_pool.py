"""The node agent's worker pool (plumbing/pool.py): engine control and plans run on lanes of their own,
so a halt and a plan start while every host thread is taken; the real agent behind busy downloads is
tests/faults/test_lost_halts.py."""
import threading

import pytest

from plumbing import pool, queue


def _request_args(task_name: str) -> tuple:
    """What a Celery worker request hands its pool: the task's name first (Request.execute_using_pool)."""
    return (task_name, "task-id", {}, b"", "application/json", "utf-8")


@pytest.fixture
def lanes():
    p = pool.TaskPool(limit=2)
    p.start()
    yield p
    p.stop()


def test_a_halt_and_a_plan_run_while_every_host_thread_is_held(lanes):
    release, started = threading.Event(), []

    def run(name, *_):
        started.append(name)
        if name == "deployments.model_copy_download":
            release.wait(10)

    try:
        for _ in range(3):  # one more than the host lane's threads: the third waits there
            lanes.apply_async(run, args=_request_args("deployments.model_copy_download"))
        halt = lanes.apply_async(run, args=_request_args("deployments.deployment_halt"))
        plan = lanes.apply_async(run, args=_request_args("deployments.deployment_run"))
        halt.wait(5)
        plan.wait(5)
        assert halt.f.done() and plan.f.done()
        assert started.count("deployments.model_copy_download") == 2
    finally:
        release.set()
    assert lanes.info["lanes"] == {"control": {"max-concurrency": pool.LANE_THREADS["control"], "threads": 1},
                                   "plans": {"max-concurrency": pool.LANE_THREADS["plans"], "threads": 1}}


@pytest.mark.parametrize("name, expected", [
    ("deployments.deployment_halt", queue.CONTROL), ("deployments.rank_halt", queue.CONTROL),
    ("deployments.deployment_forget", queue.CONTROL), ("deployments.deployment_run", queue.PLANS),
    ("deployments.deployment_follow", queue.PLANS), ("deployments.rank_run", queue.PLANS),
    ("deployments.model_copy_download", queue.HOST), ("benchmarks.run_execute", queue.HOST), ("", queue.HOST),
])
def test_each_task_runs_on_the_lane_of_the_queue_it_is_routed_to(name, expected):
    assert queue.lane(name) == expected
    routed = queue.route(name, {"queue": "node.gpu-01"})["queue"]
    assert routed == {queue.CONTROL: "node.gpu-01.control", queue.PLANS: "node.gpu-01.plans",
                      queue.HOST: "node.gpu-01"}[expected]
