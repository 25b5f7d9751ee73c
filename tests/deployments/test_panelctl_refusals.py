"""panelctl against the real ASGI server: every refusal exits non-zero with its own
code and reason, the commands it suggests exist, `status` says how to call a deployment and its last error,
and `--wait` prints only what happens after the request. A repo the hub does not know is refused before
any row exists, with the hub's answer (the Hub-compatible test server)."""
import json

import pytest

from deployments import callit
from deployments.models import Deployment, ModelRepo, Node
from panelctl import cli, status
from plumbing import tokens
from tests.factories import DeploymentEventFactory, DeploymentFactory, ModelCopyFactory, NodeFactory
from tests.hfserver import serve

STRANGER = {"pid": 4321, "user": "bob", "name": "vllm", "command": "vllm serve /tmp/other --port 8100", "memory": 0,
            "gpus": [], "display": False, "deployment": None}


@pytest.fixture
def login(live_server_asgi, operator, sent_tasks):
    return ["--url", live_server_asgi, "--token", tokens.issue(operator)]


@pytest.fixture
def hub(tmp_path, settings):
    repo = tmp_path / "hub" / "testorg" / "tiny-chat"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with serve(tmp_path / "hub") as url:
        settings.HF_ENDPOINT = url
        yield url


@pytest.fixture
def cpu_node():
    node = NodeFactory(name="cpu-01", engine_flags=["--max-num-seqs", "--max-model-len", "--enforce-eager",
                                                    "--served-model-name", "--gpu-memory-utilization"])
    return node, ModelCopyFactory(node=node, path="/models/m", model__repo_id="testorg/tiny-chat").model


def test_model_add_of_a_repo_or_revision_the_hub_does_not_know_exits_5_with_its_answer_and_adds_nothing(
        login, hub, capsys):
    assert cli.main([*login, "model-add", "testorg/does-not-exist"]) == 5
    err = capsys.readouterr()
    assert "was not found on" in err.err and "Added" not in err.out + err.err
    assert cli.main([*login, "model-add", "testorg/tiny-chat", "--revision", "no-such-branch"]) == 5
    assert "Revision 'no-such-branch' does not exist" in capsys.readouterr().err
    assert not ModelRepo.objects.exists()  # nothing to remove afterwards
    assert cli.main([*login, "model-add", "testorg/tiny-chat"]) == 0
    assert "Added testorg/tiny-chat" in capsys.readouterr().out and ModelRepo.objects.count() == 1


def test_deploy_of_a_repo_not_in_the_panel_exits_5_and_suggests_a_command_that_exists(login, capsys):
    NodeFactory(name="cpu-01")
    assert cli.main([*login, "deploy", "testorg/unknown"]) == 5
    err = capsys.readouterr().err
    assert "panelctl model-add testorg/unknown" in err
    suggested = err[err.index("panelctl model-add"):].split()[1]
    assert suggested in cli.parser()._subparsers._group_actions[0].choices  # a command panelctl has


def test_each_deploy_check_says_its_own_reason_in_the_order_a_user_can_act_on(login, cpu_node, capsys):
    node, model = cpu_node
    Node.objects.filter(pk=node.pk).update(  # a stranger's engine on port 8100
        foreign_processes=[STRANGER], listeners=[{"port": 8100, "deployment": None, **{k: STRANGER[k] for k in ("pid", "user", "command")}}])
    deploy = [*login, "deploy", "testorg/tiny-chat", "--node", node.name]

    # A bad value first: the caller's to fix, whatever holds the host.
    assert cli.main([*deploy, "--port", "8100", "--flag", "max-num-seqs=abc"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-seqs takes a whole number from 1 up, not 'abc'" in err and "Other" not in err
    # Then the port the stranger listens on, named with it.
    assert cli.main([*deploy, "--port", "8100"]) == 3
    err = capsys.readouterr().err
    assert "Port 8100 is in use on cpu-01 by PID 4321" in err and "Other" not in err
    # Then the host it holds (a node without GPUs runs one engine), with the way out.
    assert cli.main([*deploy, "--port", "8101"]) == 3
    err = capsys.readouterr().err
    assert "Other vLLM engines run on this node" in err and "PID 4321" in err and "--stop-foreign" in err
    assert "hold the chosen GPUs" not in err
    assert not Deployment.objects.exists()
    assert cli.main([*deploy, "--port", "8101", "--stop-foreign"]) == 0
    assert Deployment.objects.get().stop_foreign is True


def test_status_shows_the_endpoint_the_model_name_the_state_and_the_last_error(login, cpu_node, capsys):
    node, model = cpu_node
    d = DeploymentFactory(name="tiny-cpu", node=node, model=model, status=Deployment.Status.FAILED, port=8123,
                          status_message="The engine exited while loading.", engine_args={"served-model-name": "testorg/tiny-chat"})
    DeploymentEventFactory(deployment=d, step="launch", level="error", message="The engine exited while loading: OOM")
    assert cli.main([*login, "status", "deployment", "tiny-cpu"]) == 0
    out = capsys.readouterr().out
    assert "tiny-cpu: failed" in out and f"endpoint {callit.gateway_url(d)}" in out  # the node's gateway
    assert "model    testorg/tiny-chat" in out and "API key  needed: a caller key" in out and "panelctl keys create" in out
    assert "last error The engine exited while loading: OOM (launch" in out
    assert '"model": "testorg/tiny-chat"' in out and "from openai import OpenAI" in out  # the snippets to copy


class Timeline:
    """The events endpoint as a deployment that was deployed and stopped before, then stopped again."""

    def __init__(self, old, new):
        self.answers = [new[:1], new]
        self.old = old

    def get(self, path, **params):
        if path.endswith("/events/"):
            events = self.old + (self.answers.pop(0) if len(self.answers) > 1 else self.answers[0])
            status = "stopped" if len(events) == len(self.old) + 2 else "stopping"
            return {"state": str(len(events)), "status": status, "status_message": "", "load_phase": "",
                    "load_percent": 0, "events": events}
        return {"id": 1, "name": "tiny", "status": "stopped"}


def _event(pk, step, message):
    return {"id": pk, "step": step, "message": message, "level": "info", "started": "t", "ended": "t", "data": {}}


def test_wait_prints_only_what_happens_after_the_request(capsys):
    old = [_event(1, "queued", "Queued an hour ago."), _event(2, "launch", "Old launch."), _event(3, "stop", "Old stop."),
           _event(4, "queued", "Queued again."), _event(5, "smoke_test", "Old smoke test.")]
    new = [_event(6, "stop", "Stop requested."), _event(7, "halt", "Engine stopped.")]
    args = cli.parser().parse_args(["stop", "tiny", "--wait"])
    assert status.wait_deployment(Timeline(old, new), {"id": 1, "name": "tiny"}, args, want="stopped", since="stop") == 0
    err = capsys.readouterr().err
    assert "Stop requested." in err and "Engine stopped." in err
    assert not any(e["message"] in err for e in old)


def test_the_add_model_form_refuses_a_repo_the_hub_does_not_know_and_adds_nothing(operator_client, hub):
    response = operator_client.post("/models/add/", {"repo_id": "testorg/does-not-exist", "revision": "main"})
    assert response.status_code == 400 and "was not found on" in response.content.decode()
    assert not ModelRepo.objects.exists()
