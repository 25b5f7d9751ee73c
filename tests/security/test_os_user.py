"""Engines as their own user, the panel's side: what the agent reports and the node page shows,
and the units the panel writes (installed or downloaded) with the engine user and no secret in ExecStart=."""
import os
from pathlib import Path
from unittest import mock

import pytest

from deployments import selectors
from deployments.agent import Agent
from deployments.host import gpu, osuser
from deployments.models import Node
from deployments.node import steps
from tests.factories import DeploymentFactory, ModelCopyFactory

pytestmark = pytest.mark.django_db
KEY = "sk-unit-key-6"
ENGINE = osuser.EngineUser(name="vllm-engine", uid=990, gid=990, groups=(44,), home="/var/lib/vllm-engine",
                               group_names=("video",))


def test_the_node_page_says_who_engines_run_as(tmp_path, client, viewer, unique):
    with mock.patch("deployments.host.gpu.inventory", autospec=True, side_effect=gpu.NvmlUnavailable("none")), \
            mock.patch.object(Agent, "_report_engine", autospec=True):  # its thread would outlive the test
        agent = Agent(name=f"cpu-{unique}", model_store=str(tmp_path), address="", version="t")
        agent.register()
    facts = Node.objects.get(pk=agent.node_id).engine_user
    user = osuser.current()
    assert facts["uid"] == user.uid and facts["separate"] == user.separate
    client.force_login(viewer)
    page = client.get(f"/nodes/{agent.node_id}/").content.decode()
    want = f"{user.name} (uid {user.uid})" if user.separate else "the agent&#x27;s user"
    assert f'<dt>Engines run as</dt><dd id="engine-user">{want}' in page


def test_a_node_whose_agent_is_not_root_says_engines_run_as_the_agents_user(client, viewer):
    own = osuser.EngineUser(name="panel", uid=1000, gid=1000, separate=False,
                                note="the agent is not root, so it cannot start engines as another user")
    node = Node.objects.create(name="gpu-nonroot", engine_user=own.facts())
    client.force_login(viewer)
    page = client.get(f"/nodes/{node.pk}/").content.decode()
    assert "the agent&#x27;s user, panel (uid 1000): the agent is not root" in page


def test_an_installed_unit_runs_as_the_engine_user_with_the_api_key_in_its_environment_file():
    copy = ModelCopyFactory(path="/models/org/m")
    d = DeploymentFactory(node=copy.node, model=copy.model, engine_args={"api-key": KEY, "max-num-seqs": 8})
    argv = ["/opt/vllm", "serve", "/models/org/m", "--port", "8000", "--api-key", KEY, "--max-num-seqs", "8"]
    with mock.patch.object(osuser, "current", return_value=ENGINE):
        text, secret_env = steps.unit_text(d, argv, {"A": "1"}, "/var/log/x.log", cwd=Path("/models/org/m"))
    assert secret_env == {"VLLM_API_KEY": KEY} and KEY not in text and "--api-key" not in text
    assert "WorkingDirectory=/models/org/m\n" in text  # the model's folder, as the agent starts it (not /)
    assert "User=vllm-engine\n" in text and "NoNewPrivileges=yes\n" in text and "SupplementaryGroups=video\n" in text
    assert "EnvironmentFile=" in text


def test_the_downloaded_unit_names_the_user_the_nodes_agent_reported():
    copy = ModelCopyFactory(path="/models/org/m")
    copy.node.engine_user = ENGINE.facts()
    copy.node.save()
    d = DeploymentFactory(node=copy.node, model=copy.model, env={"HF_TOKEN": KEY})  # (--api-key is the panel's now)
    name, text = selectors.deployment_unit(d)
    assert "User=vllm-engine\n" in text and "--api-key" not in text and KEY not in text
    assert f"EnvironmentFile=/etc/systemd/system/{name}.env" in text and "WorkingDirectory=/models/org/m\n" in text
    assert "PANEL_ENGINE" not in text  # not running: no engine for the unit's to be


def test_the_downloaded_unit_of_a_running_deployment_carries_its_marker_so_its_engine_is_the_deployments():
    from deployments.host import ownership

    copy = ModelCopyFactory(path="/models/org/m")
    d = DeploymentFactory(node=copy.node, model=copy.model, status="ready", pid=4242, marker="9.abcdef0123456789")
    _, text = selectors.deployment_unit(d)
    assert f"{ownership.MARKER_VAR}=9.abcdef0123456789" in text and f"{ownership.ROLE_VAR}=engine" in text
