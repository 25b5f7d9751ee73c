"""The host firewall of multi-node and Ray deployments (deployments/host/firewall.py), with the real thing: nftables
in this host's network namespace, real cgroups, and two network namespaces wired to this host by veth pairs, one
a deployment's node ("peer"), one not ("stranger"). A process in a guarded group listens on every interface, as
Ray's GCS and torch's TCPStore do: the peer and loopback reach it, the stranger is refused, the engine's API port
stays open to all, a child forked later is guarded too, and release() takes the rules and the cgroup away.
"""
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest

from deployments.host import firewall
from tests import netns
from tests.conftest import free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and nftables need root")
# `./panel test` installs nftables; the fast tier installs nothing, so there these tests wait for the whole run.
needs_nft = pytest.mark.tools  # nftables: ./panel test installs it; the fast tier leaves these out

# Binds every port it is given on 0.0.0.0 once told to (a socket is tagged with its maker's cgroup, so it is moved
# first), forks a child that binds one more, prints "up", then holds them.
LISTENER = """import os, socket, sys
sys.stdin.readline()
ports = [int(p) for p in sys.argv[1:]]
def listen(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
    return s
held = [listen(p) for p in ports[:-1]]
if os.fork() == 0:
    held.append(listen(ports[-1])); print("up", flush=True); sys.stdin.readline(); os._exit(0)
sys.stdin.readline()
"""


@pytest.fixture
def namespaces():
    with netns.machines("peer", "stranger") as found:
        yield found


@needs_nft
def test_a_guarded_group_is_reached_from_loopback_and_its_nodes_only_and_its_api_port_from_anywhere(namespaces):
    assert shutil.which("nft"), "install nftables (apt-get install nftables): multi-node deploys need it"
    (peer_ns, peer_ip, host_for_peer), (stranger_ns, _, host_for_stranger) = namespaces["peer"], namespaces["stranger"]
    cluster, api, child_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(cluster), str(api), str(child_port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    marker = f"0.fwtest{uuid.uuid4().hex[:12]}"
    try:
        message = firewall.guard(marker, [proc.pid], ["127.0.0.1", peer_ip], open_ports=[api])
        assert f"reachable from loopback and {', '.join(sorted(['127.0.0.1', peer_ip]))}; port {api} open to all" in message
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "up"
        root = firewall.cgroup2_root()
        members = (root / firewall.PARENT / firewall.key_of(marker) / "cgroup.procs").read_text().split()
        assert str(proc.pid) in members and len(members) == 2  # the child forked after guard() was born inside
        ports = [cluster, api, child_port]
        assert netns.connect(peer_ns, host_for_peer, ports) == {cluster: "open", api: "open", child_port: "open"}
        assert netns.connect(stranger_ns, host_for_stranger, ports) == {
            cluster: "ConnectionRefusedError", api: "open", child_port: "ConnectionRefusedError"}
        assert netns.connect(None, "127.0.0.1", ports) == {cluster: "open", api: "open", child_port: "open"}
        # An unguarded listener on the same host is none of the firewall's business: the stranger reaches it.
        with socket_on_all() as other:
            assert netns.connect(stranger_ns, host_for_stranger, [other]) == {other: "open"}
        assert firewall.release(marker, wait_s=0.2) is False  # processes left: the rules stay
        assert netns.connect(stranger_ns, host_for_stranger, [cluster]) == {cluster: "ConnectionRefusedError"}
    finally:
        proc.kill()
        proc.wait(5)
    proc.stdin.close()
    assert firewall.release(marker, wait_s=5) is True
    listed = subprocess.run(["nft", "list", "table", "inet", firewall.TABLE], capture_output=True, text=True).stdout
    assert firewall.key_of(marker) not in listed
    assert not (firewall.cgroup2_root() / firewall.PARENT / firewall.key_of(marker)).exists()


class socket_on_all:
    """A listening socket on every interface, outside any guarded group."""

    def __enter__(self):
        self.sock = socket.socket()
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen()
        return self.sock.getsockname()[1]

    def __exit__(self, *exc):
        self.sock.close()


def test_a_host_without_nftables_refuses_with_the_reason_and_firewall_off_says_so(monkeypatch):
    monkeypatch.setattr(firewall, "_checked", None)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(firewall.FirewallError, match=r"nftables is not installed on this host .*apt-get install nftables"):
        firewall.check()
    monkeypatch.setenv("PANEL_FIREWALL", "off")
    assert firewall.check().startswith("Not firewalled: PANEL_FIREWALL=off")
    assert firewall.guard("1.x", [os.getpid()], ["10.0.0.1"]).startswith("Not firewalled")


@needs_nft
def test_a_group_in_a_cgroup_of_its_own_is_matched_there_not_moved(namespaces):
    """A systemd unit's or an engine container's processes sit in their own cgroup (system.slice/x.service): that
    one is guarded, and they stay in it (systemd and Docker track their processes by it)."""
    stranger_ns, _, host_ip = namespaces["stranger"]
    own = firewall.cgroup2_root() / f"pfwunit-{uuid.uuid4().hex[:6]}" / "x.service"
    own.mkdir(parents=True)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(port), str(free_port())], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    marker = f"0.fwunit{uuid.uuid4().hex[:12]}"
    try:
        (own / "cgroup.procs").write_text(str(proc.pid))
        message = firewall.guard(marker, [proc.pid], ["127.0.0.1"])
        assert f"(cgroup /{own.parent.name}/x.service)" in message
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "up"
        assert firewall.cgroup_of(proc.pid) == f"/{own.parent.name}/x.service"  # not moved
        assert firewall.covered(proc.pid) == firewall.key_of(marker)
        assert netns.connect(stranger_ns, host_ip, [port]) == {port: "ConnectionRefusedError"}
    finally:
        proc.kill()
        proc.wait(5)
        proc.stdin.close()  # its child reads EOF and exits
        assert firewall.release(marker, wait_s=5) is True
        for folder in (own, own.parent):
            folder.rmdir()


@needs_nft
def test_sweep_drops_the_rules_of_a_group_that_ended_unwatched():
    """An agent that died with its engines: the next one's sweep removes the rules and cgroups of groups with no
    process left, and keeps a live group's."""
    dead, live = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    markers = [f"0.fwsweep{uuid.uuid4().hex[:12]}" for _ in range(2)]
    try:
        for proc, marker in zip((dead, live), markers):
            firewall.guard(marker, [proc.pid], ["127.0.0.1"])
        dead.kill()
        dead.wait(5)
        swept = firewall.sweep()
        assert firewall.key_of(markers[0]) in swept and firewall.key_of(markers[1]) not in swept
        listed = subprocess.run(["nft", "list", "table", "inet", firewall.TABLE], capture_output=True, text=True).stdout
        assert firewall.key_of(markers[0]) not in listed and firewall.covered(live.pid) == firewall.key_of(markers[1])
        assert not (firewall.cgroup2_root() / firewall.PARENT / firewall.key_of(markers[0])).exists()
    finally:
        live.kill()
        live.wait(5)
        assert firewall.release(markers[1]) is True


def test_a_host_that_never_guarded_a_group_stops_and_sweeps_without_a_table():
    """A fresh host has no `inet panel_engines` table until a multi-node or Ray group is guarded; every stop
    releases its marker and every agent start sweeps: neither may fail there (CI on a fresh machine failed
    single-node stops with "nft refused the panel's rules: No such file or directory"). Run in a network
    namespace of its own, where the table does not exist whatever this host's other runs do."""
    with netns.machines("fresh") as found:
        ns = found["fresh"][0]
        # What release() and sweep() run once they found no process left (`ip netns exec` remounts /sys, so
        # the cgroup side is not reachable from in there: the nft side is called as they call it).
        code = "from deployments.host import firewall; firewall._rebuild(drop={firewall.key_of('0.freshgroup')})"
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]  # with or without nftables installed
        if shutil.which("nft"):
            assert subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet", firewall.TABLE],
                                  capture_output=True).returncode != 0  # nothing created either
