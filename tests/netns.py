"""Network namespaces wired to this host by veth pairs, to connect from "another machine" (needs root): a
deployment's node, or a stranger that is none. Used by the firewall tests (deployments/host/firewall.py)."""
import contextlib
import subprocess
import sys
import time
import uuid

from tests.conftest import free_port

CONNECT = """import socket, sys
for port in sys.argv[2:]:
    try:
        socket.create_connection((sys.argv[1], int(port)), timeout=3).close(); print(port, "open")
    except OSError as exc:
        print(port, type(exc).__name__)
"""


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@contextlib.contextmanager
def machines(*roles):
    """{role: (namespace, its address, this host's address towards it)}, each on a /30 of its own; all removed
    afterwards."""
    tag = uuid.uuid4().hex[:6]
    made, links, found = [], [], {}
    try:
        for i, role in enumerate(roles):
            ns, here, there = f"pfw-{i}-{tag}", f"pf{i}{tag}h", f"pf{i}{tag}n"
            prefix, last = f"10.{200 + i}.{int(tag[:2], 16)}", int(tag[2:4], 16) & 0xFC
            host_ip, ns_ip = f"{prefix}.{last + 1}", f"{prefix}.{last + 2}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            links.append(here)
            _ip("link", "set", there, "netns", ns)
            _ip("addr", "add", f"{host_ip}/30", "dev", here)
            _ip("link", "set", here, "up")
            _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", there)
            _ip("-n", ns, "link", "set", there, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", host_ip)  # every address of this host, as from outside
            found[role] = (ns, ns_ip, host_ip)
        for ns, _, host_ip in found.values():
            _reachable(ns, host_ip)
        yield found
    finally:
        for link in links:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=20)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def _reachable(ns, host, timeout=30.0):
    """Wait until `host` answers from namespace `ns` (a refused connection to a port nobody listens on is an answer):
    a test's first connection must not race the new link (a loaded CI run once timed out on all three ports)."""
    deadline, seen = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        seen = connect(ns, host, [free_port()])
        if set(seen.values()) <= {"open", "ConnectionRefusedError"}:
            return
        time.sleep(0.2)
    raise AssertionError(f"{host} never answered from namespace {ns} within {timeout:.0f} s: {seen}")


def connect(ns, host, ports) -> dict[int, str]:
    """{port: "open" or the error's name} for a TCP connection from namespace `ns` (None: this host) to each port."""
    argv = [sys.executable, "-c", CONNECT, host, *map(str, ports)]
    out = subprocess.run(["ip", "netns", "exec", ns, *argv] if ns else argv, capture_output=True, text=True, timeout=300)
    return {int(port): what for port, what in (line.split() for line in out.stdout.splitlines())}
