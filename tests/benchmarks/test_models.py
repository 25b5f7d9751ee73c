import pytest
from django.db import IntegrityError, transaction

from benchmarks.models import BenchmarkRun
from plumbing.states import InvalidTransition
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory

pytestmark = pytest.mark.django_db


def test_a_run_goes_queued_running_done_and_not_back():
    run = BenchmarkRunFactory()
    run.transition(BenchmarkRun.Status.RUNNING)
    run.transition(BenchmarkRun.Status.DONE)
    with pytest.raises(InvalidTransition):
        run.transition(BenchmarkRun.Status.RUNNING)
    assert run.status == BenchmarkRun.Status.DONE


def test_a_run_targets_its_deployment_or_its_url():
    assert BenchmarkRunFactory().target.startswith("deploy-")
    assert BenchmarkRunFactory(deployment=None, base_url="http://10.0.0.5:8000").target == "http://10.0.0.5:8000"


def test_one_point_per_concurrency_level_and_they_come_back_in_order():
    run = BenchmarkRunFactory()
    for c in (64, 1, 8):
        BenchmarkPointFactory(run=run, concurrency=c)
    assert [p.concurrency for p in run.points.all()] == [1, 8, 64]
    with pytest.raises(IntegrityError), transaction.atomic():  # one point per level, enforced by the database
        BenchmarkPointFactory(run=run, concurrency=8)
