"""The launcher's children started again with backoff (panelctl/launcher.py Children.restart_exited), on real
processes and the launcher's own clock: 1 s, doubled at each exit, back to 1 s after a minute up."""
import sys

from panelctl import launcher


def test_a_child_that_dies_is_started_again_after_its_delay_which_doubles_and_resets_after_a_minute_up():
    children = launcher.Children()
    first = children.start("agent", [sys.executable, "-c", "raise SystemExit(9)"], {})
    first.wait(10)
    t0 = children.started["agent"]
    try:
        assert children.restart_exited(t0 + 0.1) == ["agent exited with code 9; starting it again in 1 s (the rest "
                                                     "of the panel keeps running)."]
        assert children.restart_exited(t0 + 0.5) == []  # not yet due: nothing started, nothing said again
        said = children.restart_exited(t0 + 1.2)
        second = children.procs[0][1]
        assert second is not first and said == [f"agent started again (PID {second.pid})."]
        second.wait(10)
        assert children.restart_exited(t0 + 1.3)[0].endswith("starting it again in 2 s (the rest of the panel keeps running).")
        children.restart_exited(t0 + 3.4)
        third = children.procs[0][1]
        third.wait(10)
        assert children.restart_exited(t0 + 3.5)[0].endswith("in 4 s (the rest of the panel keeps running).")
        children.restart_exited(t0 + 7.6)
        children.procs[0][1].wait(10)
        up_a_minute = children.started["agent"] + launcher.RESTART_RESET_S
        assert children.restart_exited(up_a_minute)[0].endswith("in 1 s (the rest of the panel keeps running).")
    finally:
        children.stop(timeout=1)


def test_the_web_reads_from_the_launcher_that_a_nodes_agent_is_restarting_and_the_node_page_and_api_say_so(
        tmp_path, settings, db):
    """What `./panel start` records of its children (PANEL_VAR_DIR/launcher.json) is what the node's page and API
    read: "node agent restarting" while the launcher is to start the agent again, with its exit code and when; not
    once it started it again, and never for another node's agent."""
    from django.test import Client

    from deployments import launcherstate
    from tests.factories import NodeFactory, UserFactory
    from tests.helpers import api_client

    settings.VAR_DIR = tmp_path
    node, other = NodeFactory(name="gpu-01"), NodeFactory(name="gpu-02")
    children = launcher.Children(tmp_path / launcher.LAUNCHER_STATE, "gpu-01")
    assert launcher.LAUNCHER_STATE == launcherstate.STATE_FILE
    agent = children.start("nodeagent", [sys.executable, "-c", "raise SystemExit(137)"], {})
    agent.wait(10)
    t0 = children.started["nodeagent"]
    api = api_client(UserFactory(role="viewer"))
    try:
        children.restart_exited(t0 + 0.1)
        shown = api.get(f"/api/nodes/{node.name}/").json()["agent_restart"]
        assert shown["code"] == 137 and round(shown["next_start"] - shown["exited"]) == 1, shown
        assert api.get(f"/api/nodes/{other.name}/").json()["agent_restart"] is None
        client = Client()
        client.force_login(UserFactory(role="viewer"))
        assert "node agent restarting" in client.get(f"/nodes/{node.pk}/").content.decode()
        children.restart_exited(t0 + 1.2)  # started again
        assert api.get(f"/api/nodes/{node.name}/").json()["agent_restart"] is None
        assert "node agent restarting" not in client.get(f"/nodes/{node.pk}/").content.decode()
    finally:
        children.stop(timeout=1)
