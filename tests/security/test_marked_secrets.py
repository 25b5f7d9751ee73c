"""Env variables marked secret on the form/API are masked exactly like secret-looking names."""
from unittest import mock

import pytest
from rest_framework.test import APIClient

from benchmarks import services as bench
from deployments import payloads, secrets
from deployments.models import Deployment
from deployments.node import plan
from deployments.services import deploys
from tests.deployments.test_deploys import FLAGS, FakeHost, host  # noqa: F401 - host: the plan's node, faked at its boundary
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
VALUE = "hunter2-value"


def _deployment(marked):
    copy = ModelCopyFactory(path="/models/org/m")
    return DeploymentFactory(node=copy.node, model=copy.model, status="ready", secret_env=marked,
                             env={"VLLM_MY_VAR": VALUE, "NCCL_PROTO": "LL"}, log_tail=f"INFO starting with VLLM_MY_VAR={VALUE}")


@pytest.mark.parametrize("marked", [["VLLM_MY_VAR"], []])
def test_a_marked_variable_is_masked_everywhere_and_an_unmarked_one_shown(marked, viewer, viewer_client, sent_tasks):
    d = _deployment(marked)
    client = APIClient()
    client.force_authenticate(viewer)
    texts = {url: client.get(url).content.decode() for url in (
        f"/api/deployments/{d.pk}/", "/api/deployments/", f"/api/deployments/{d.pk}/logs/", f"/api/deployments/{d.pk}/unit/")}
    texts.update({url: viewer_client.get(url).content.decode() for url in (
        f"/deployments/{d.pk}/", f"/deployments/{d.pk}/unit/")})
    unit_text, unit_secret = plan._unit(d, ["vllm", "serve"])
    texts["unit text"] = unit_text
    run = bench.run_create(params={}, deployment=d)
    texts["run environment"] = str(run.environment)
    for url in (f"/benchmarks/{run.pk}/export.json", f"/benchmarks/{run.pk}/export.csv"):
        texts[url] = viewer_client.get(url).content.decode()
    if marked:
        leaks = [where for where, text in texts.items() if VALUE in text]
        assert leaks == [] and unit_secret == {"VLLM_MY_VAR": VALUE}
        assert client.get(f"/api/deployments/{d.pk}/").json()["env"] == {"VLLM_MY_VAR": secrets.MASK, "NCCL_PROTO": "LL"}
    else:
        assert client.get(f"/api/deployments/{d.pk}/").json()["env"] == {"VLLM_MY_VAR": VALUE, "NCCL_PROTO": "LL"}
        assert VALUE in texts["unit text"] and unit_secret == {}


@pytest.mark.parametrize("marked", [["VLLM_MY_VAR"], []])
def test_the_plan_sends_the_engines_new_log_lines_live_without_a_marked_value(marked, host, tmp_path):
    # The plan run for real on the node (host modules replaced at their boundary, as in
    # tests/deployments/test_deploys.py): its follow loop reads the engine's log and sends new lines to the page.
    node = NodeFactory(model_store=str(tmp_path), engine_flags=sorted(FLAGS))
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    d = DeploymentFactory(node=node, model=copy.model, port=8000, status=Deployment.Status.QUEUED, secret_env=marked,
                          env={"VLLM_MY_VAR": VALUE})
    with mock.patch.object(payloads, "send_log_lines", autospec=True) as send:
        def launch_printing_the_value(spec):  # vLLM prints its non-default args and env at start
            handle = FakeHost.launch(host, spec)
            with spec.log_path.open("a") as log:
                log.write(f"INFO 12-01 10:00:00 [envs.py:1] environment: VLLM_MY_VAR={VALUE}\n")
            return handle

        host.mocks["processes.launch"].side_effect = launch_printing_the_value
        plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == Deployment.Status.READY, d.status_message
    sent = [line for call in send.call_args_list for line in call.args[1]]
    assert all(call.args[0] == d.pk for call in send.call_args_list) and "Loading weights took 1.5 seconds" in sent
    if marked:
        assert f"VLLM_MY_VAR={secrets.MASK}" in sent[-1] and not [line for line in sent if VALUE in line], sent
    else:
        assert sent[-1].endswith(f"VLLM_MY_VAR={VALUE}")


def test_the_edit_form_masks_a_marked_variable_and_a_mask_sent_back_keeps_it(operator_client, sent_tasks):
    d = _deployment(["VLLM_MY_VAR"])
    page = operator_client.get(f"/deployments/{d.pk}/edit/").content.decode()
    assert VALUE not in page and secrets.MASK in page and 'value="VLLM_MY_VAR"' in page
    deploys.deployment_redeploy(d, env={"VLLM_MY_VAR": secrets.MASK, "NCCL_PROTO": "Simple"})
    d.refresh_from_db()
    assert d.env == {"VLLM_MY_VAR": VALUE, "NCCL_PROTO": "Simple"} and d.secret_env == ["VLLM_MY_VAR"]


def test_the_api_refuses_a_marked_name_that_is_not_in_env(operator):
    d = _deployment([])
    client = APIClient()
    client.force_authenticate(operator)
    response = client.post("/api/deployments/", {"model": d.model.pk, "node": d.node.name, "env": {"VLLM_MY_VAR": "x"},
                                                 "secret_env": ["OTHER"], "preset": "none"}, format="json")
    assert response.status_code == 400 and "OTHER" in str(response.json()["error"]["fields"]["secret_env"]), response.json()
    response = client.post(f"/api/deployments/{d.pk}/restart/", {"secret_env": ["OTHER"]}, format="json")
    assert response.status_code == 400 and "OTHER" in response.content.decode()


def test_the_form_reads_marked_names_and_refuses_one_not_in_env():
    from deployments.forms import DeployForm

    node = _deployment([]).node
    data = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
            "stall_seconds": 600, "env": "VLLM_MY_VAR=x\nNCCL_PROTO=LL"}
    form = DeployForm({**data, "secret_env": "VLLM_MY_VAR, NCCL_PROTO"}, node=node)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["secret_names"] == ["VLLM_MY_VAR", "NCCL_PROTO"]
    form = DeployForm({**data, "secret_env": "OTHER"}, node=node)
    assert not form.is_valid() and "OTHER" in form.errors["secret_env"][0]


def test_panelctl_deploy_sends_secret_env():
    from panelctl import cli

    args = cli.parser().parse_args(["deploy", "org/m", "--node", "n", "--env", "VLLM_MY_VAR=x", "--secret-env", "VLLM_MY_VAR"])
    assert args.secret_env == ["VLLM_MY_VAR"]
