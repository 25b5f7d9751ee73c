"""The moment the head turns ready, two paths move a worker rank from loading to running: the rank's own plan
(rank_run's follow) and the agent's watch (ranks_watch, for a rank whose plan ended with an agent restart). Whichever
comes second must find it running and carry on: a guarded move to the state the rank is already in aborted
rank_run's follow, and its abort handler halted the rank's engine (the worker node's engine shut down at the head's
first request: 'Connection closed by peer' in the head's all_reduce, two CI runs of test_multinode)."""
import os
from unittest import mock

import psutil
import pytest

from deployments.models import Deployment, DeploymentRank
from deployments.node import ranks
from tests.deployments.test_multinode import _node
from tests.factories import DeploymentFactory

pytestmark = pytest.mark.django_db
R = DeploymentRank.State


@pytest.fixture
def loading():
    """A head just turned ready and its rank 1, still loading, whose engine is this process (it runs)."""
    head, worker = _node("gpu-a"), _node("gpu-b")
    d = DeploymentFactory(name="kimi", node=head, status=Deployment.Status.READY, master_port=29500)
    rank = DeploymentRank.objects.create(deployment=d, node=worker, rank=1, gpu_indices=[0, 1], state=R.LOADING,
                                         pid=os.getpid(), pgid=os.getpgid(0), marker="7.rank-marker",
                                         pid_create_time=psutil.Process().create_time())
    return rank


def _follow_quietly(rank):
    follow = mock.Mock(**{"read.return_value": [], "exited.return_value": None, "tail": ""})
    follow.progress.phase, follow.progress.percent = "server_up", 100
    with mock.patch.object(ranks.lifecycle, "LogFollow", return_value=follow):
        ranks._follow(rank)


def test_the_watch_moving_the_rank_to_running_first_does_not_abort_its_plan(loading):
    with mock.patch.object(ranks, "rank_running", return_value=True):
        ranks.ranks_watch(loading.node_id)  # the watch sees the head ready first
    assert DeploymentRank.objects.get(pk=loading.pk).state == R.RUNNING
    with mock.patch.object(ranks, "_halt") as halt:
        _follow_quietly(loading)  # the rank's own plan, a poll later: it must not abort (and halt the engine)
    halt.assert_not_called()
    assert DeploymentRank.objects.get(pk=loading.pk).state == R.RUNNING and loading.load_percent == 100.0


def test_the_plan_moving_it_first_leaves_the_watch_nothing_to_do(loading):
    _follow_quietly(loading)
    with mock.patch.object(ranks, "rank_running", return_value=True):
        ranks.ranks_watch(loading.node_id)
    assert DeploymentRank.objects.get(pk=loading.pk).state == R.RUNNING
