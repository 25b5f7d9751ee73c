"""The key one node's gateway sends another's when it forwards a caller's request to a deployment over there.

One key per ordered pair of nodes and per hour: an HMAC of SECRET_KEY (which every node of a panel shares, so
nothing is stored or fetched) over the two node names and the hour's number. The sender names itself in
`X-Panel-Node`; the receiver takes the key only from that node's address, only for itself as the destination,
and only for the hour it is in or the ones either side (clocks of two nodes differ by seconds, a request may
start at the turn of the hour). So a copy of one (read off a network where TLS was not put between the
gateways, docs/gateway.md) is good for one sender's address towards one node for two hours at most; changing
SECRET_KEY changes every key at once.
"""
import functools
import hashlib
import hmac
import ssl
import time

from django.conf import settings

HEADER = "X-Panel-Node"  # the sending gateway's node
PERIOD_S = 3600
PREFIX = "vcp-gw-"


def epoch(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // PERIOD_S)


def secret(source: str, destination: str, hour: int) -> str:
    return _secret(settings.SECRET_KEY, source, destination, hour)


@functools.lru_cache(maxsize=1024)
def _secret(key: str, source: str, destination: str, hour: int) -> str:
    """Made once per pair and hour, not per request (every forwarded request checks up to three)."""
    message = f"vllm control panel: gateway {source} to {destination}, hour {hour}".encode()
    return PREFIX + hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def current(source: str, destination: str, now: float | None = None) -> str:
    """The key `source`'s gateway sends `destination`'s now."""
    return secret(source, destination, epoch(now))


def valid(token: str, source: str, destination: str, now: float | None = None) -> bool:
    hour = epoch(now)
    return any(hmac.compare_digest(token, secret(source, destination, h)) for h in (hour, hour - 1, hour + 1))


def server_context() -> ssl.SSLContext | None:
    """TLS for this node's gateway (GATEWAY_TLS_CERT and _KEY), or None: plain HTTP."""
    if not settings.GATEWAY_TLS_CERT:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.GATEWAY_TLS_CERT, settings.GATEWAY_TLS_KEY or None)
    return context


def client_context() -> ssl.SSLContext | None:
    """How this gateway checks the other nodes' gateways (GATEWAY_TLS_CA, else the system's CAs), or None when
    the gateways speak plain HTTP."""
    if not settings.GATEWAY_TLS_CERT:
        return None
    return ssl.create_default_context(cafile=settings.GATEWAY_TLS_CA or None)
