"""The loopback door (deployments/host/firewall.py): engine API ports answer only the agent's uid, with the real
thing — nftables in this host's network namespace, a real listener, connections made by a child running as
`nobody`; and the host doctor's exposure audit, which asks each running engine's routes without a key as `nobody`,
turns what answered into a red check and a notification, and clears both once the door is shut.

Each test's ports are noted under a node name of its own: agents (and tests) of one host share the set.
The real CPU vLLM behind a shut door, reached through the gateway and refused to `nobody`, is
tests/e2e/test_deploy.py."""
import http.server
import os
import socket
import subprocess
import sys
import threading

import pytest

from deployments.host import doctor, door, firewall
from deployments.models import Deployment
from deployments.node import lifecycle
from deployments.notify import checks
from deployments.notify.models import Alert
from deployments.services import doctor as doctor_service
from tests.conftest import free_port, wait_until
from tests.factories import DeploymentFactory, NodeFactory

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="nftables and another uid need root"),
              pytest.mark.tools]  # nftables: ./panel test installs it; the fast tier leaves these out


@pytest.fixture(autouse=True)
def proven_here(monkeypatch):
    """Each test proves the door itself (the verdict is cached per process)."""
    monkeypatch.setattr(door, "_door", None)


@pytest.fixture
def owner(unique):
    return f"door-{unique}"


@pytest.fixture
def engine(owner):
    """An HTTP server answering every GET with 200 (vLLM's unkeyed routes do much the same), on 127.0.0.1."""

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401 if self.path.startswith("/v1/") else 200)  # vLLM keys /v1 only
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    door.reopen(server.server_address[1], owner)


def _answered_to_the_agent(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=3):
        return True


def test_a_shut_port_refuses_every_other_uid_answers_the_agent_and_reopens_for_its_owner_only(engine, owner):
    assert door.reach_as(door.NOBODY, "127.0.0.1", [engine]) == {engine: "open"}  # the door as it was
    shut, why = door.door_check()
    assert shut, why
    assert door.shut(engine, owner) == f"Port {engine} answers only the agent and the gateway (uid 0)."
    assert door.door_ports()[engine] == owner
    assert door.reach_as(door.NOBODY, "127.0.0.1", [engine]) == {engine: "ConnectionRefusedError"}
    routes = door.ask_as(door.NOBODY, {engine: list(doctor.EXPOSURE_ROUTES)})[engine]
    assert set(routes.values()) == {"ConnectionRefusedError"}, routes  # every route: the connection never opens
    assert _answered_to_the_agent(engine)
    door.reopen(engine, f"{owner}-other")  # another node's stop: not its port
    assert door.door_ports()[engine] == owner
    # The rule names the agent's uid and only refuses, never accepts.
    listed = subprocess.run(["nft", "list", "chain", "inet", firewall.TABLE, "output"], capture_output=True,
                            text=True, timeout=20).stdout
    assert 'oif "lo" ct state new tcp dport @engine_ports meta skuid != 0 reject with tcp reset' in listed
    door.reopen(engine, owner)
    assert engine not in door.door_ports()
    assert door.reach_as(door.NOBODY, "127.0.0.1", [engine]) == {engine: "open"}


def test_an_agent_start_sweeps_its_nodes_ports_but_those_of_engines_it_keeps_and_never_another_nodes(owner):
    kept, ended, theirs = free_port(), free_port(), free_port()
    for port, who in ((kept, owner), (ended, owner), (theirs, f"{owner}-other")):
        door.shut(port, who)
    assert door.sweep(owner, keep={kept}) == [ended]
    ports = door.door_ports()
    assert (ports.get(kept), ports.get(ended), ports.get(theirs)) == (owner, None, f"{owner}-other")
    door.shut(theirs, owner)  # a port taken over (the other node's engine is gone): now this node's
    assert door.door_ports()[theirs] == owner
    door.sweep(owner, keep=set())
    assert not {kept, ended, theirs} & set(door.door_ports())


def test_with_the_firewall_off_the_door_says_why_and_shuts_nothing(monkeypatch, engine, owner):
    monkeypatch.setenv("PANEL_FIREWALL", "off")
    assert door.door_check() == (False, "PANEL_FIREWALL=off on this agent: engine ports answer every local user")
    assert door.shut(engine, owner).startswith(f"Port {engine} answers every local user: PANEL_FIREWALL=off")
    assert engine not in door.door_ports()
    check = doctor.door_check()
    assert (check.name, check.status) == ("engine_door", doctor.FAIL)


@pytest.mark.django_db
def test_a_launch_shuts_the_engines_port_before_it_binds_and_a_halt_reopens_it(tmp_path):
    """lifecycle.launch/halt, with a real process that binds the port it is given (as `vllm serve --port` does)."""
    node, port = NodeFactory(), free_port()
    d = DeploymentFactory(node=node, port=port, status=Deployment.Status.STARTING)
    serve = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
             f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(300)")
    lifecycle.launch(d, lifecycle.Launch(argv=[sys.executable, "-c", serve], env=dict(os.environ),
                                         log_path=tmp_path / "engine.log"))
    try:
        assert door.door_ports()[port] == node.name
        wait_until(lambda: door.reach_as(0, "127.0.0.1", [port])[port] == "open", timeout=30, message="the bind")
        assert door.reach_as(door.NOBODY, "127.0.0.1", [port]) == {port: "ConnectionRefusedError"}
    finally:
        lifecycle.halt(d)
    assert port not in door.door_ports()


@pytest.mark.django_db
def test_the_exposure_audit_turns_an_open_engine_into_a_red_check_and_an_alert_and_clears_both_once_shut(
        engine, owner, tmp_path):
    node = NodeFactory(name="exposed-node")
    DeploymentFactory(node=node, name="open-engine", port=engine, status=Deployment.Status.READY)
    report = doctor_service.node_doctor_run(node.pk, str(tmp_path), root=str(tmp_path))
    exposure = next(c for c in report["checks"] if c["name"] == "exposure")
    assert exposure["status"] == doctor.FAIL
    # Everything but /v1 answered `nobody` (200 here; vLLM answers 405 to a GET on its POST routes): each named.
    assert exposure["data"]["open"] == {"open-engine": {r: 200 for r in doctor.EXPOSURE_ROUTES if not r.startswith("/v1/")}}
    assert "open-engine: /invocations (200), /tokenize (200)" in exposure["summary"]
    node.refresh_from_db()
    checks.node_check(node, None)
    alert = Alert.objects.get(node=node, kind="engine_exposed", resolved=None)
    assert "engines answer local users without a key" in alert.title and alert.data["engines"] == ["open-engine"]

    door.shut(engine, owner)
    report = doctor_service.node_doctor_run(node.pk, str(tmp_path), root=str(tmp_path))
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["engine_door"]["status"] == doctor.PASS and doctor_service.door_shut(node.__class__.objects.get(pk=node.pk))
    assert by_name["exposure"]["status"] == doctor.PASS and "no route answered" in by_name["exposure"]["summary"]
    node.refresh_from_db()
    checks.node_check(node, None)
    alert.refresh_from_db()
    assert alert.resolved is not None and "answer only the panel again" in alert.resolve_note
