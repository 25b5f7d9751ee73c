"""steps.move, the one place a plan moves a deployment's status: the node gateways hear of every move to or from
ready at once (deployments/gateway/changes.py), not at their next poll of the database."""
from unittest import mock

import pytest

from deployments.models import Deployment
from deployments.node import steps
from tests.factories import DeploymentFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status


def test_a_move_to_or_from_ready_tells_the_gateways_and_others_do_not():
    d = DeploymentFactory(status=S.STARTING)
    with mock.patch("deployments.gateway.changes.changed", autospec=True) as changed:
        steps.move(d, S.LOADING)
        assert not changed.called
        steps.move(d, S.READY)
        changed.assert_called_once_with("deployments")
        steps.move(d, S.FAILED, "the engine exited")
        assert changed.call_count == 2
    assert Deployment.objects.get(pk=d.pk).status == S.FAILED
