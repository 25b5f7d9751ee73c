from datetime import timedelta

import pytest
from django.utils import timezone

from deployments.models import Deployment
from deployments.models import ModelCopy, Node
from plumbing.states import InvalidTransition
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory

S = Deployment.Status
pytestmark = pytest.mark.django_db

HAPPY_PATH = [S.PREPARING, S.STOPPING_OTHERS, S.STARTING, S.LOADING, S.READY, S.STOPPING, S.STOPPED]


def test_a_deployment_walks_the_whole_happy_path_and_stamps_its_times():
    deployment = DeploymentFactory()
    for status in HAPPY_PATH:
        deployment.transition(status)
    deployment.save()
    deployment.refresh_from_db()
    assert deployment.status == S.STOPPED
    assert deployment.started <= deployment.ready_at <= deployment.stopped_at


@pytest.mark.parametrize(
    "start, target",
    [(S.QUEUED, S.READY), (S.QUEUED, S.LOADING), (S.STOPPED, S.READY), (S.STOPPED, S.STOPPING),
     (S.LOADING, S.STARTING), (S.READY, S.PREPARING), (S.STOPPING, S.READY), (S.FAILED, S.READY)],
)
def test_a_deployment_refuses_a_jump_the_state_machine_does_not_allow(start, target):
    deployment = DeploymentFactory(status=start)
    with pytest.raises(InvalidTransition, match=f"cannot go from {start} to {target}"):
        deployment.transition(target)
    assert deployment.status == start


def test_every_active_status_can_fail_with_a_message():
    for status in Deployment.ACTIVE - {S.STOPPING}:
        deployment = DeploymentFactory(status=status)
        deployment.transition(S.FAILED, "engine exited with code 1")
        assert deployment.status == S.FAILED
        assert deployment.status_message == "engine exited with code 1"
        assert deployment.stopped_at is not None


def test_a_stopped_or_failed_deployment_can_be_queued_again_for_a_redeploy():
    for status in (S.STOPPED, S.FAILED):
        deployment = DeploymentFactory(status=status)
        deployment.transition(S.QUEUED)
        assert deployment.status == S.QUEUED


def test_a_model_copy_moves_only_along_its_download_states():
    copy = ModelCopyFactory(state=ModelCopy.State.READY)
    with pytest.raises(InvalidTransition, match="cannot go from ready to downloading"):
        copy.transition(ModelCopy.State.DOWNLOADING)
    copy.transition(ModelCopy.State.DELETING)
    with pytest.raises(InvalidTransition, match="cannot go from deleting to queued"):
        copy.transition(ModelCopy.State.QUEUED)
    failed = ModelCopyFactory(state=ModelCopy.State.FAILED, error="boom")
    failed.transition(ModelCopy.State.QUEUED, error="")
    assert failed.state == ModelCopy.State.QUEUED and failed.error == ""


def test_every_model_copy_state_is_reachable_and_every_group_names_real_states():
    reachable = {to for targets in ModelCopy.TRANSITIONS.values() for to in targets} | {ModelCopy.State.QUEUED}
    assert reachable == set(ModelCopy.State.values)
    assert ModelCopy.ACTIVE | ModelCopy.DOWNLOADABLE <= set(ModelCopy.State.values)


def test_active_and_terminal_groups_cover_every_status_once():
    assert Deployment.ACTIVE | Deployment.TERMINAL == set(S.values)
    assert not Deployment.ACTIVE & Deployment.TERMINAL


def test_a_node_is_online_until_three_heartbeats_are_missed():
    now = timezone.now()  # one clock for the heartbeat and the question: a busy host's pause moves neither
    assert Node.is_online(now - timedelta(seconds=14), 5, now=now)
    assert not Node.is_online(now - timedelta(seconds=16), 5, now=now)
    assert NodeFactory(heartbeat_seconds=5, last_heartbeat=timezone.now()).online
    assert not NodeFactory(last_heartbeat=None).online


def test_a_node_queue_is_named_after_the_node():
    assert NodeFactory(name="gpu-07").queue == "node.gpu-07"
