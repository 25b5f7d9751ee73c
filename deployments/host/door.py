"""The loopback door: an engine's API port listens on 127.0.0.1, where every local user and every other engine could
reach all of vLLM's routes, most of which it never asks a key for (/invocations, /tokenize, /pause, and with
VLLM_SERVER_DEV_MODE=1 /collective_rpc, /sleep). So every engine's API port is in the `engine_ports` set of the
panel's nftables table (host/firewall.py), and new loopback connections to it are refused unless their socket
belongs to the agent's own uid (the gateway, the agent's health checks, smoke tests and benchmarks); nftables'
output hook sees the connecting socket's owner (`meta skuid`), the input hook no longer does on loopback:

    set engine_ports { type inet_service }
    chain output { hook output; oif lo ct state new tcp dport @engine_ports meta skuid != <agent uid> reject }

`door_check()` proves it once per agent process (a probe port refused to `nobody`, answered to the agent);
`shut(port, node)` before an engine binds, `reopen(port, node)` once it stopped, `sweep(node, keep)` at agent start
drops a node's ports whose engines ended unwatched (each element notes its node: agents of one host share the set).
`ask_as()` is the host doctor's exposure audit: an engine's routes asked as `nobody`. Plain Python, no Django.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess

from deployments.host import osuser
from deployments.host.firewall import TABLE, FirewallError, _Lock, _nft, _nft_bin, _refused, _table_exists, enabled

NOBODY = 65534  # the unprivileged uid the door is proven against
_door: tuple[bool, str] | None = None  # door_check()'s verdict in this process


def _ensure_door() -> None:
    """The set of engine ports and the output chain refusing them to other uids (created once per host)."""
    listed = subprocess.run([_nft_bin(), "list", "chain", "inet", TABLE, "output"], capture_output=True, text=True,
                            timeout=20)
    if listed.returncode == 0 and "@engine_ports" in listed.stdout:
        return
    _nft(f"add table inet {TABLE}\n"
         f"add set inet {TABLE} engine_ports {{ type inet_service; }}\n"
         f"add chain inet {TABLE} output {{ type filter hook output priority filter; policy accept; }}\n"
         f"flush chain inet {TABLE} output\n"
         f'add rule inet {TABLE} output oif "lo" ct state new tcp dport @engine_ports meta skuid != {os.geteuid()} '
         f"reject with tcp reset\n")


def door_check() -> tuple[bool, str]:
    """(shut, why): whether engine ports can be closed to every uid but the agent's here, proven once per process
    by a probe port refused to `nobody` and answered to the agent; the reason when they cannot."""
    global _door
    if _door is None:
        _door = _door_test()
    return _door


def _door_test() -> tuple[bool, str]:
    if not enabled():
        return False, "PANEL_FIREWALL=off on this agent: engine ports answer every local user"
    if os.geteuid() != 0:
        return False, "the agent is not root: engines run as its own user, so no uid can tell them apart"
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        port = probe.getsockname()[1]
        with _Lock():
            _ensure_door()
            _nft(f'add element inet {TABLE} engine_ports {{ {port} comment "selftest" }}\n')
        try:
            answered = not _refused("127.0.0.1", port)
            other = reach_as(NOBODY, "127.0.0.1", [port])[port]
        finally:
            with _Lock():
                _nft(f"delete element inet {TABLE} engine_ports {{ {port} }}\n", check=False)
    except FirewallError as exc:
        return False, str(exc)
    finally:
        probe.close()
    if not answered or other == "open":
        return False, (f"the nftables rule on engine ports does not work here (probe port {port}: "
                       f"{'refused to the agent' if not answered else 'open to nobody'})")
    return True, f"engine ports answer only uid {os.geteuid()} (the agent and the gateway): nftables table inet {TABLE}"


_CONNECT = """import json, socket, sys
out = {}
for port in sys.argv[2:]:
    try:
        socket.create_connection((sys.argv[1], int(port)), timeout=3).close(); out[port] = "open"
    except OSError as exc:
        out[port] = type(exc).__name__
print(json.dumps(out))
"""


def reach_as(uid: int, host: str, ports: list[int]) -> dict[int, str]:
    """{port: "open" or why not} for TCP connections made by a child running as `uid` (root only)."""
    return {int(k): v for k, v in _as(uid, _CONNECT, [host, *map(str, ports)], 30).items()}


_ASK = """import http.client, json, sys
out = {}
for port, routes in json.loads(sys.argv[1]).items():
    out[port] = {}
    for route in routes:
        try:
            c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=3)
            c.request("GET", route)
            out[port][route] = c.getresponse().status
            c.close()
        except OSError as exc:
            out[port][route] = type(exc).__name__
print(json.dumps(out))
"""


def ask_as(uid: int, routes: dict[int, list[str]]) -> dict[int, dict[str, int | str]]:
    """{port: {route: HTTP status, or why no answer}} for GETs without a key made by a child running as `uid`
    (root only). GET only: it acts on nothing (a POST-only route answers 405, which shows it is reachable)."""
    return {int(k): v for k, v in _as(uid, _ASK, [json.dumps(routes)], 60).items()}


def _as(uid: int, source: str, args: list[str], timeout: float) -> dict:
    try:
        return osuser.python_as(source, args, uid, uid, timeout=timeout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise FirewallError(f"cannot connect as uid {uid}: {exc}", permanent=True) from exc


def shut(port: int, owner: str) -> str:
    """Close engine port `port` to every uid but the agent's, before the engine binds it (vLLM binds its API port
    only once loaded), noted as `owner`'s (the node's name: agents of one host share the table); a line for the
    timeline. A port another owner had is taken over."""
    shut_here, why = door_check()
    if not shut_here:
        return f"Port {port} answers every local user: {why}."
    element = f'{int(port)} comment "{_owner(owner)} {os.getpid()}"'
    with _Lock():
        _ensure_door()
        # add, delete, add again in one transaction: the port is never open, and its owner is the new one.
        _nft(f"add element inet {TABLE} engine_ports {{ {int(port)} }}\n"
             f"delete element inet {TABLE} engine_ports {{ {int(port)} }}\n"
             f"add element inet {TABLE} engine_ports {{ {element} }}\n")
    return f"Port {port} answers only the agent and the gateway (uid {os.geteuid()})."


def _owner(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)[:100]


def door_ports() -> dict[int, str]:
    """{port: owner} of the door's set now (empty without a table)."""
    return {port: owner for port, (owner, _) in door_elements().items()}


def door_elements() -> dict[int, tuple[str, int]]:
    """{port: (owner, PID of the process that shut it)} of the door's set now (empty without a table)."""
    nft = shutil.which("nft")
    out = subprocess.run([nft, "-j", "list", "set", "inet", TABLE, "engine_ports"], capture_output=True, text=True,
                         timeout=20) if nft else None
    if out is None or out.returncode != 0:
        return {}
    found = {}
    for item in json.loads(out.stdout).get("nftables", []):
        for e in item.get("set", {}).get("elem", []):
            if isinstance(e, dict):
                owner, _, pid = e["elem"].get("comment", "").partition(" ")
                found[e["elem"]["val"]] = (owner, int(pid) if pid.isdigit() else 0)
            elif isinstance(e, int):
                found[e] = ("", 0)
    return found


def reopen(port: int | None, owner: str) -> None:
    """Take `owner`'s `port` out of the set: its engine stopped (another owner's is left alone)."""
    if port and shutil.which("nft") and _table_exists():
        with _Lock():
            _drop({int(port)} & {p for p, o in door_ports().items() if o == _owner(owner)})


def sweep(owner: str, keep: set[int]) -> list[int]:
    """Drop `owner`'s ports but `keep` (its engines that ended while no agent watched); the ports dropped."""
    if not enabled() or not shutil.which("nft") or not _table_exists():
        return []
    with _Lock():
        gone = sorted(p for p, o in door_ports().items() if o == _owner(owner) and p not in keep)
        _drop(set(gone))
    return gone


def _drop(ports: set[int]) -> None:
    if ports:
        _nft(f"delete element inet {TABLE} engine_ports {{ {', '.join(map(str, sorted(ports)))} }}\n", check=False)
