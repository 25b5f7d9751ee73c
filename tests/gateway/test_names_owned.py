"""Served names and aliases belong to whoever deployed them: another operator's deploy, redeploy or route that
would answer to one of them is refused (403) while that deployment is active, and leaves nothing behind."""
import pytest
from rest_framework.test import APIClient

from deployments.gateway.models import Route
from deployments.models import Deployment
from tests.deployments.test_deploys import FLAGS
from tests.factories import GpuFactory, ModelCopyFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(sent_tasks):
    nodes = []
    for name in ("gpu-01", "gpu-02"):
        node = NodeFactory(name=name, engine_flags=sorted(FLAGS))
        for i in range(2):
            GpuFactory(node=node, index=i)
        nodes.append(node)
    copy = ModelCopyFactory(node=nodes[0], path="/models/m")
    ModelCopyFactory(node=nodes[1], model=copy.model, path="/models/m")
    return copy.model


def as_user(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def deploy(user, model, node, **body):
    return as_user(user).post("/api/deployments/", {"model": model.pk, "node": node, "gpus": [0], "preset": "none",
                                                    **body}, format="json")


def test_another_operator_cannot_take_a_served_name_or_alias_while_it_is_served(fleet):
    alice, bob = UserFactory(username="alice", role="operator"), UserFactory(role="operator")
    mine = deploy(alice, fleet, "gpu-01", engine_args={"served-model-name": "kimi"}, aliases=["k2"])
    assert mine.status_code == 202, mine.json()
    for body, field in (({"engine_args": {"served-model-name": "kimi"}}, "engine_args"),  # the served name
                        ({"engine_args": {"served-model-name": "bob-kimi"}, "aliases": ["k2"]}, "aliases"),
                        ({"engine_args": {"served-model-name": "k2"}}, "engine_args")):  # her alias as his name
        refused = deploy(bob, fleet, "gpu-02", **body)
        assert refused.status_code == 403, refused.json()
        error = refused.json()["error"]
        assert error["code"] == "forbidden" and "which alice deployed" in error["fields"][field][0], error
    assert Deployment.objects.count() == 1 and Route.objects.count() == 1  # nothing of his was kept
    assert deploy(bob, fleet, "gpu-02", engine_args={"served-model-name": "bob-kimi"}).status_code == 202
    # Her own second replica takes her name; an admin may take any name.
    assert deploy(alice, fleet, "gpu-02", gpus=[1], engine_args={"served-model-name": "kimi"}, name="kimi-2").status_code == 202
    admin = UserFactory(role="admin")
    assert deploy(admin, fleet, "gpu-01", gpus=[1], engine_args={"served-model-name": "k2"}, name="k2-admin").status_code == 202


def test_a_stopped_deployment_holds_no_name_and_a_replacement_takes_it_over(fleet):
    alice, bob = UserFactory(role="operator"), UserFactory(role="operator")
    assert deploy(alice, fleet, "gpu-01", engine_args={"served-model-name": "kimi"}).status_code == 202
    hers = Deployment.objects.get()
    # Replacing her deployment (it is stopped for his) takes its name with it.
    taken = deploy(bob, fleet, "gpu-02", engine_args={"served-model-name": "kimi"}, replace=[hers.pk])
    assert taken.status_code == 202, taken.json()
    Deployment.objects.all().update(status=Deployment.Status.STOPPED)
    again = deploy(alice, fleet, "gpu-01", gpus=[1], engine_args={"served-model-name": "kimi"}, name="kimi-again")
    assert again.status_code == 202, again.json()
    # His restart with the name, hers active again: refused, and his row is as it was.
    his = Deployment.objects.get(pk=taken.json()["id"])
    refused = as_user(bob).post(f"/api/deployments/{his.pk}/restart/", {}, format="json")
    assert refused.status_code == 403, refused.json()
    assert Deployment.objects.get(pk=his.pk).status == Deployment.Status.STOPPED
