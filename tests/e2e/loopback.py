"""What a real engine the panel started must look like from outside, for the end-to-end tests that
start one anyway: every socket its processes listen on is a loopback one, its API port among them; from the
node's own network address it answers nothing; its OpenAI routes refuse a request without its key (or with a
wrong one) and answer the panel's key."""
import ipaddress
import socket

import httpx
import psutil

from deployments import engineapikey
from deployments.models import Deployment
from tests.e2e.test_multinode import listening

ASK = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]}


def _outward_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (where a caller on the network would knock)."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]


def _refused(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def assert_behind_loopback_and_key(d: Deployment) -> list[tuple[str, int, str, int]]:
    """Check `d`'s running engine (a single-node one); returns its listening sockets."""
    d = Deployment.objects.get(pk=d.pk)
    sockets = listening(d.marker)  # the engine's processes and their descendants, read from the processes
    assert ("127.0.0.1", d.port) in {(a, p) for a, p, _, _ in sockets}, sockets
    outside = [s for s in sockets if not ipaddress.ip_address(s[0]).is_loopback]
    assert outside == [], f"the engine listens beyond loopback: {outside}"
    for address in _outward_addresses():
        assert _refused(address, d.port), f"the engine's port answers at {address}"
    url = f"http://127.0.0.1:{d.port}"
    assert httpx.post(f"{url}/v1/chat/completions", json=ASK, timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer not-the-key"}, timeout=30).status_code == 401
    key = engineapikey.of(d)
    answer = httpx.post(f"{url}/v1/chat/completions", json=ASK, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0, answer.text
    return sockets
