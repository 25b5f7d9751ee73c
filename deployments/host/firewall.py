"""The host firewall of a multi-node or Ray deployment: every port its processes open is reachable only from
loopback and the deployment's own nodes. The engine's API server listens on loopback only (the node's
gateway is the public door), so no port of theirs is open to all. Plain Python, no Django.

Why not addresses: Ray 2.60 (GCS, raylet, object manager, workers), torch's TCPStore (the master port), gloo,
NCCL and vLLM's ZeroMQ queues listen on every interface whatever address they are given, many on ports they
pick themselves. So the match is on who owns the socket, not on its port: each launched process group
(one marker: a Ray node, an engine rank) is put in a cgroup of its own, `<cgroup2>/panel-engines/<key>`,
and nftables' `socket cgroupv2` finds, for each new connection or datagram arriving from the network,
the cgroup of the socket it is for. One table of the panel's (`inet panel_engines`):

    map guarded { type cgroupsv2 : verdict }                    # a launched group's cgroup -> its chain
    chain input { hook input; ct state new socket cgroupv2 level 2 vmap @guarded }
    chain <key> { iif lo return; ip saddr {nodes} return; [tcp dport {open_ports} return;] reject }

Replies to connections an engine opens itself are not new: they pass. The table only rejects; it never
accepts what another firewall drops. A process started under a cgroup of its own already (a systemd unit, an
engine container) is matched in that cgroup and not moved. `release(key)` removes the key's element and chain
(and its cgroup) once the group is gone; `sweep()` does it for groups that ended while no agent watched.

The table also holds the loopback door of every engine's API port (host/door.py).

Where nft, cgroup v2 or CAP_NET_ADMIN is missing, or the match does not work (the self-test in `check()`
fails), multi-node and Ray deployments are refused with the reason; `PANEL_FIREWALL=off` on an agent turns
the firewall off there (its timeline says so) for hosts whose cluster network is isolated by other means.
"""
from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from deployments.host.processes import EngineError

TABLE = "panel_engines"
PARENT = "panel-engines"  # our cgroups: <cgroup2 root>/panel-engines/<key>
NFT_CGROUP_BASE = Path("/sys/fs/cgroup")  # nft resolves a cgroupv2 path under this folder (nftables 1.0)
LEVEL = 2  # the depth of the cgroups matched: panel-engines/<key>, system.slice/<unit>.service
LOCK = Path("/run/panel-engines-nft.lock")
_checked: str | None = None  # the self-test passed in this process
BASE_CHAINS = {"input", "output"}  # the table's own chains, never a group's


class FirewallError(EngineError):
    """The firewall cannot be set up here, or a rule cannot be installed: the engine cannot be launched safely
    (an EngineError, so every launch path already fails the plan with its message)."""


def enabled() -> bool:
    return os.environ.get("PANEL_FIREWALL", "on").strip().lower() not in {"off", "0", "false", "no"}


def key_of(marker: str) -> str:
    """A launched group's name in nft and cgroupfs, from its ownership marker (`<id>.<nonce>`)."""
    return "e" + re.sub(r"[^A-Za-z0-9_]", "_", marker)


# --- cgroups ----------------------------------------------------------------------------------------------

def cgroup2_root() -> Path:
    """Where cgroup v2 is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError as exc:
        raise FirewallError(f"cannot read the mounts: {exc}", permanent=True) from exc
    for line in lines:
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            head = fields[0].split()
            if head[3] != "/":  # mounted from inside a cgroup namespace: nft's levels count from the real root
                raise FirewallError("cgroup v2 is mounted from inside a cgroup namespace (a container?): nftables "
                                    "cannot match the engines' cgroups from here", permanent=True)
            return Path(head[4])
    raise FirewallError("cgroup v2 is not mounted on this host", permanent=True)


def cgroup_of(pid: int) -> str:
    """`pid`'s cgroup v2 path ("/system.slice/x.service"), or "" when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return ""


def _nft_path(root: Path, cgroup: str) -> str:
    try:
        base = root.relative_to(NFT_CGROUP_BASE)
    except ValueError as exc:
        raise FirewallError(f"cgroup v2 is mounted at {root}, not under {NFT_CGROUP_BASE} where nft looks",
                            permanent=True) from exc
    return str(base / cgroup.strip("/"))


def _enclose(root: Path, key: str, pids: list[int]) -> str:
    """The cgroup (path below the cgroup2 root) the group's sockets are matched in: a cgroup of its own that
    is not the agent's (a unit's, a container's) when it has one at LEVEL; else panel-engines/<key>, the
    processes moved in. Moved right after launch: the engine binds nothing for its first second (Python's
    imports), and every child it forks later is born inside."""
    own = cgroup_of(os.getpid())
    current = {cgroup_of(pid) for pid in pids} - {""}
    if len(current) == 1:
        (path,) = current
        if path != own and path.count("/") == LEVEL and not path.startswith(f"/{PARENT}/"):
            return path.strip("/")
    folder = root / PARENT / key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for pid in pids:
            try:
                (folder / "cgroup.procs").write_text(f"{pid}\n")
            except ProcessLookupError:
                continue
    except OSError as exc:
        raise FirewallError(f"cannot put the engine in a cgroup of its own ({folder}): {exc.strerror or exc}",
                            permanent=True) from exc
    return f"{PARENT}/{key}"


# --- nft ---------------------------------------------------------------------------------------------------

def _nft_bin() -> str:
    nft = shutil.which("nft")
    if nft is None:
        raise FirewallError("nftables is not installed on this host (the nft command is missing): install it "
                            "(Debian/Ubuntu: apt-get install nftables)", permanent=True)
    return nft


def _nft(script: str, *, check: bool = True) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run([_nft_bin(), "-f", "-"], input=script, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FirewallError(f"nft did not run: {exc}", permanent=True) from exc
    if check and out.returncode != 0:
        why = out.stderr.strip().splitlines()[0] if out.stderr.strip() else f"exit {out.returncode}"
        if "Operation not permitted" in out.stderr:
            why = "not permitted (the agent needs CAP_NET_ADMIN)"
        raise FirewallError(f"nft refused the panel's rules: {why}", permanent=True)
    return out


def _base() -> str:
    """The table, its map and its input chain (created once, by whichever agent of the host comes first)."""
    return (f"add table inet {TABLE}\n"
            f"add map inet {TABLE} guarded {{ type cgroupsv2 : verdict; }}\n"
            f"add chain inet {TABLE} input {{ type filter hook input priority filter; policy accept; }}\n")


def _ensure_base() -> None:
    listed = subprocess.run([_nft_bin(), "list", "chain", "inet", TABLE, "input"],
                            capture_output=True, text=True, timeout=20)
    if listed.returncode == 0 and "vmap @guarded" in listed.stdout:
        return
    _nft(_base() + f"add rule inet {TABLE} input ct state new socket cgroupv2 level {LEVEL} vmap @guarded\n")


class _Lock:
    """One agent of the host at a time changes the table (several agents share a test host)."""

    def __enter__(self):
        self.f = open(LOCK, "a")  # noqa: SIM115 - held until __exit__
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        self.f.close()


def _chain(key: str, peers: list[str], open_ports: list[int]) -> str:
    v4 = [a for a in peers if ipaddress.ip_address(a).version == 4]
    v6 = [a for a in peers if ipaddress.ip_address(a).version == 6]
    lines = [f"add chain inet {TABLE} {key}", f"flush chain inet {TABLE} {key}",
             f'add rule inet {TABLE} {key} iif "lo" return']
    if v4:
        lines.append(f"add rule inet {TABLE} {key} ip saddr {{ {', '.join(v4)} }} return")
    if v6:
        lines.append(f"add rule inet {TABLE} {key} ip6 saddr {{ {', '.join(v6)} }} return")
    if open_ports:
        lines.append(f"add rule inet {TABLE} {key} tcp dport {{ {', '.join(map(str, sorted(set(open_ports))))} }} return")
    lines += [f"add rule inet {TABLE} {key} meta l4proto tcp reject with tcp reset",
              f"add rule inet {TABLE} {key} reject with icmpx type port-unreachable"]
    return "\n".join(lines) + "\n"


def _element(nft_path: str, key: str | None = None) -> str:
    return f'{{ "{nft_path}" : jump {key} }}' if key else f'{{ "{nft_path}" }}'


# --- what the deploy plan calls ----------------------------------------------------------------------------

def check() -> str:
    """Refuse (FirewallError, permanent, saying why) where the firewall cannot work; a line for the timeline.
    Once per agent process it proves the match on this host: a listener in a guarded cgroup is refused."""
    global _checked
    if not enabled():
        return "Not firewalled: PANEL_FIREWALL=off on this agent (its cluster network must be isolated otherwise)."
    if _checked is None:
        _checked = _self_test()
    return _checked


def _self_test() -> str:
    _nft_bin()
    root = cgroup2_root()
    key = f"selftest{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", _PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        path = _enclose(root, key, [child.pid])
        with _Lock():
            _ensure_base()
            nft_path = _nft_path(root, path)
            # No loopback exception here: the probe's refusal on 127.0.0.1 proves the cgroup match works.
            _nft(f"add chain inet {TABLE} {key}\nflush chain inet {TABLE} {key}\n"
                 f"add rule inet {TABLE} {key} meta l4proto tcp reject with tcp reset\n"
                 f"add element inet {TABLE} guarded {_element(nft_path, key)}\n")
        try:
            child.stdin.write("go\n")
            child.stdin.flush()
            port = int(child.stdout.readline())
            refused = _refused("127.0.0.1", port)
        finally:
            with _Lock():
                _rebuild(drop={key})
        if not refused:
            raise FirewallError("the nftables match on the engines' cgroups does not work on this host (a test "
                                "listener in one was still reachable)", permanent=True)
    finally:
        child.kill()
        child.wait(5)
        _rmdir(root, key)
    return f"Firewalled: nftables table inet {TABLE}, engines matched by cgroup ({root})."


_PROBE = """import socket, sys
sys.stdin.readline()  # moved into its cgroup first: a socket is tagged with its maker's cgroup
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True); sys.stdin.readline()
"""


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return False
    except OSError:
        return True


def guard(marker: str, pids: list[int], nodes: list[str], open_ports: list[int] = ()) -> str:
    """Admit new connections to the sockets of `pids` (a launched group and its future children) only from
    loopback and `nodes` (the deployment's node addresses), and to `open_ports` from anywhere; a line for the
    timeline. Called again for the same marker (the head's Ray, then its engine) it replaces the ports."""
    if not enabled():
        return check()
    check()
    root = cgroup2_root()
    key = key_of(marker)
    path = _enclose(root, key, list(pids))
    nft_path = _nft_path(root, path)
    script = _chain(key, addresses(nodes), list(open_ports))
    with _Lock():
        _ensure_base()
        _nft(script + f"add element inet {TABLE} guarded {_element(nft_path, key)}\n"
             if not _has_element(nft_path) else script)
    ports = f"; port {', '.join(map(str, open_ports))} open to all" if open_ports else ""
    return f"Firewalled (cgroup /{path}): reachable from loopback and {', '.join(sorted(set(nodes))) or 'no node'}{ports}."


def addresses(nodes: list[str]) -> list[str]:
    """The IP addresses of `nodes` (an agent's --address is an IP or a host name, resolved here)."""
    found = []
    for node in filter(None, nodes):
        try:
            found.append(str(ipaddress.ip_address(node)))
        except ValueError:
            try:
                found += [info[4][0] for info in socket.getaddrinfo(node, None, proto=socket.IPPROTO_TCP)]
            except OSError as exc:
                raise FirewallError(f"cannot resolve node address {node}: {exc}", permanent=True) from exc
    return sorted(set(found))


def _has_element(nft_path: str) -> bool:
    return nft_path in _elements()


def _elements() -> dict[str, str]:
    """{nft cgroup path: chain} of the guarded map (nft names an element by its cgroup's path)."""
    out = subprocess.run([_nft_bin(), "-j", "list", "map", "inet", TABLE, "guarded"],
                         capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        return {}
    found = {}
    for item in json.loads(out.stdout).get("nftables", []):
        for elem in item.get("map", {}).get("elem", []):
            path, verdict = elem
            if isinstance(path, str):
                found[path] = verdict.get("jump", {}).get("target", "")
    return found


def covered(pid: int) -> str:
    """The chain guarding `pid`'s sockets ("" when none): its cgroup, or its ancestor at LEVEL, is in the map."""
    try:
        root = cgroup2_root()
    except FirewallError:
        return ""
    parts = cgroup_of(pid).strip("/").split("/")
    if len(parts) < LEVEL:
        return ""
    return _elements().get(_nft_path(root, "/".join(parts[:LEVEL])), "")


def release(marker: str, wait_s: float = 3.0) -> bool:
    """Remove the group's rules (and its cgroup of ours) once no process is left in the cgroups it is matched in
    (within `wait_s`); True when removed. A group with processes left keeps its rules: they stay firewalled until
    `sweep()` finds them gone."""
    if not enabled() or shutil.which("nft") is None:
        return False
    try:
        root = cgroup2_root()
    except FirewallError:
        return False
    key = key_of(marker)
    paths = [path for path, chain in _elements().items() if chain == key] or [_nft_path(root, f"{PARENT}/{key}")]
    deadline = time.monotonic() + wait_s
    while any(map(_occupied, paths)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if any(map(_occupied, paths)):
        return False
    with _Lock():
        _rebuild(drop={key})
    _rmdir(root, key)
    return True


def _occupied(nft_path: str) -> bool:
    try:
        return bool((NFT_CGROUP_BASE / nft_path / "cgroup.procs").read_text().strip())
    except OSError:
        return False  # gone: systemd removes a stopped unit's cgroup


def _rebuild(drop: set[str]) -> None:
    """Write the map again without the dropped keys and without elements whose cgroup is gone (nft can no
    longer name those, so they cannot be deleted one by one), and delete every chain no element jumps to. One
    nft transaction: at no moment is a live group unguarded. No table yet (a fresh host, where no multi-node
    or Ray group was ever guarded): nothing to drop."""
    if not _table_exists() or "input" not in _chains():  # no group was ever guarded here (the door only)
        return
    keep = {path: chain for path, chain in _elements().items()
            if chain not in drop and (NFT_CGROUP_BASE / path).is_dir()}
    script = f"flush map inet {TABLE} guarded\n" + "".join(
        f"add element inet {TABLE} guarded {_element(path, chain)}\n" for path, chain in keep.items())
    script += "".join(f"delete chain inet {TABLE} {chain}\n" for chain in _chains() - set(keep.values()) - BASE_CHAINS)
    _nft(script)


def _table_exists() -> bool:
    """Whether the panel's table is there: never on a host without nftables (nothing was ever guarded there, so a
    stop's release and an agent's sweep have nothing to do)."""
    nft = shutil.which("nft")
    return nft is not None and subprocess.run([nft, "list", "table", "inet", TABLE], capture_output=True,
                                              timeout=20).returncode == 0


def _chains() -> set[str]:
    out = subprocess.run([_nft_bin(), "-j", "list", "table", "inet", TABLE], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        return set()
    return {item["chain"]["name"] for item in json.loads(out.stdout).get("nftables", []) if "chain" in item}


def sweep() -> list[str]:
    """Drop the rules of every group no process is left in (ended while no agent watched) and remove its cgroup
    of ours; the keys released."""
    if not enabled() or shutil.which("nft") is None:
        return []
    try:
        root = cgroup2_root()
    except FirewallError:
        return []
    gone = {chain for path, chain in _elements().items() if not _occupied(path)}
    with _Lock():
        _rebuild(drop=gone)
    for folder in (root / PARENT).glob("e*"):
        if not _occupied(_nft_path(root, f"{PARENT}/{folder.name}")):
            _rmdir(root, folder.name)
            gone.add(folder.name)
    return sorted(gone)


def _rmdir(root: Path, key: str) -> None:
    try:
        (root / PARENT / key).rmdir()
    except OSError:
        pass  # processes left (EBUSY) or already gone

