"""Every deployment says how to call it (page, API), under the repo id by default,
and a deploy from the API or panelctl gets the deploy form's own defaults for the node. That is
always through the node's gateway, with a caller key, under the served name and the route's aliases."""
import json
import shlex

import pytest
from django.urls import reverse

from django.conf import settings

from deployments import callit
from deployments.gateway.models import Route
from deployments.models import Deployment
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent_tasks")]


@pytest.fixture
def admin_api():
    """An admin: even the role that may set every other flag may not set the engine's key."""
    from rest_framework.test import APIClient

    from tests.factories import UserFactory

    client = APIClient()
    client.force_authenticate(UserFactory(role="admin"))
    return client


@pytest.fixture
def cpu_model():
    node = NodeFactory(name="cpu-01", address="10.0.0.5")
    copy = ModelCopyFactory(node=node, path="/var/models/acme--tiny-chat", model__repo_id="acme/tiny-chat")
    return node, copy.model


def _form_values(form) -> dict:
    """What a browser submits for a form nobody changed: each field's initial value as POST data."""
    data = {}
    for name in form.fields:
        value = form[name].value()
        if value in (None, False, "", []):
            continue
        data[name] = [str(v) for v in value] if isinstance(value, (list, tuple)) else value
    return data


def test_a_deploy_without_a_served_name_serves_the_repo_id_and_the_api_says_how_to_call_it(api, cpu_model):
    node, model = cpu_model
    answer = api.post("/api/deployments/", {"model": model.pk, "node": node.name}, format="json")
    assert answer.status_code == 202, answer.json()
    d = Deployment.objects.get()
    assert d.engine_args["served-model-name"] == "acme/tiny-chat"  # stored, so the plan and the unit show it
    call = api.get(f"/api/deployments/{d.pk}/").json()["call"]
    gateway = f"http://10.0.0.5:{settings.GATEWAY_PORT}/v1"  # the node's gateway, never the engine's own port
    assert call["base_url"] == gateway and call["models"] == ["acme/tiny-chat"]
    assert call["key_required"] is True and "panelctl keys create" in call["key_help"]
    words = shlex.split(call["curl"].replace("\\\n", " "))
    assert words[1] == f"{gateway}/chat/completions" and "Authorization: Bearer $OPENAI_API_KEY" in words
    assert json.loads(words[words.index("-d") + 1])["model"] == "acme/tiny-chat"
    compile(call["python"], "<call it>", "exec")  # the snippet is Python as shown
    assert f'base_url="{gateway}"' in call["python"] and 'model="acme/tiny-chat"' in call["python"]
    assert 'api_key=os.environ["OPENAI_API_KEY"]' in call["python"]
    assert '"--served-model-name" "acme/tiny-chat"' in api.get(f"/api/deployments/{d.pk}/unit/").json()["text"]


def test_the_port_the_nodes_gateway_reported_and_the_routes_aliases_are_shown(cpu_model):
    node, model = cpu_model
    node.gateway_port = 4123
    node.save()
    d = DeploymentFactory(node=node, model=model, engine_args={"served-model-name": "tiny"})
    Route.objects.create(deployment=d, names=["kimi", "tiny", " "])
    call = callit.call(d)
    assert call["base_url"] == "http://10.0.0.5:4123/v1" and call["models"] == ["tiny", "kimi"]


def test_a_served_name_the_user_gives_wins(api, cpu_model):
    node, model = cpu_model
    api.post("/api/deployments/", {"model": model.pk, "node": node.name, "engine_args": {"served-model-name": "tiny"}},
             format="json")
    d = Deployment.objects.get()
    assert d.engine_args["served-model-name"] == "tiny" and callit.call(d)["models"] == ["tiny"]


def test_a_deployment_stored_without_a_served_name_is_called_by_the_path_vllm_was_given(cpu_model):
    node, model = cpu_model
    d = DeploymentFactory(node=node, model=model, engine_args={"enforce-eager": True})
    assert callit.call(d)["models"] == ["/var/models/acme--tiny-chat"]


@pytest.mark.parametrize("field,value", [("engine_args", {"api-key": "sk-very-secret-1234"}),
                                         ("engine_args", {"--api_key": "sk-very-secret-1234"}),
                                         ("env", {"VLLM_API_KEY": "sk-very-secret-1234"})])
def test_a_deploy_with_its_own_api_key_is_refused_saying_callers_keys_replace_it(admin_api, cpu_model, field, value):
    """The engine's key is the panel's (a user's --api-key broke the smoke test and every benchmark)."""
    node, model = cpu_model
    answer = admin_api.post("/api/deployments/", {"model": model.pk, "node": node.name, field: value}, format="json")
    assert answer.status_code == 400, answer.json()
    text = json.dumps(answer.json())
    assert "set by the panel" in text and "panelctl keys create" in text and "sk-very-secret-1234" not in text
    assert not Deployment.objects.exists()


def test_the_deployment_page_shows_the_model_name_and_copyable_snippets(operator_client, cpu_model):
    node, model = cpu_model
    d = DeploymentFactory(node=node, model=model, engine_args={"served-model-name": "acme/tiny-chat"},
                          status=Deployment.Status.READY)
    page = operator_client.get(reverse("deployment-detail", args=[d.pk])).content.decode()
    call = page[page.index('id="call-it"'):]
    assert '<code class="call-model">acme/tiny-chat</code>' in call and "a caller key" in call
    assert f"http://10.0.0.5:{settings.GATEWAY_PORT}/v1" in call and reverse("account") in call
    for snippet in ("call-curl", "call-python"):
        assert f'data-copy="{snippet}"' in call and f'id="{snippet}"' in call
    assert "panel/copy.js" in page


def test_the_deploy_form_shows_the_repo_id_as_the_served_name(operator_client, cpu_model):
    node, model = cpu_model
    page = operator_client.get(reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}").content.decode()
    assert 'name="served_model_name" value="acme/tiny-chat"' in page


@pytest.mark.parametrize("gpus", [0, 2])
def test_the_api_and_panelctl_deploy_with_the_forms_defaults_for_the_node(api, operator_client, gpus):
    node = NodeFactory(name=f"node-{gpus}")
    for i in range(gpus):
        GpuFactory(node=node, index=i)
    model = ModelCopyFactory(node=node, path="/models/m").model
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    form = operator_client.get(url).context["form"]
    posted = operator_client.post(url, {**_form_values(form), "name": "by-form", "node_id": node.pk})
    assert posted.status_code == 302, posted.content.decode()[:2000]
    by_form = Deployment.objects.get(name="by-form")
    Deployment.objects.filter(pk=by_form.pk).update(status=Deployment.Status.STOPPED)  # the host is free again
    answer = api.post("/api/deployments/", {"model": model.pk, "node": node.name, "name": "by-api",
                                            **({"gpus": [0]} if gpus else {})}, format="json")
    assert answer.status_code == 202, answer.json()
    by_api = Deployment.objects.get(name="by-api")
    assert by_api.engine_args == by_form.engine_args and by_api.env == by_form.env
    assert by_api.engine_args["gpu-memory-utilization"] == 0.9  # the form's field default, on either kind of node
    assert ("enforce-eager" in by_api.engine_args) == (gpus == 0)  # the node's preset
