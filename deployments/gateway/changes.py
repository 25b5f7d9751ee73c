"""Telling every node gateway that keys or routes changed: a version in Redis that the gateways poll twice a
second (and a pub/sub message they may listen to), so a revoked key is refused within a second everywhere
without a database read per request. If Redis is unreachable the gateways fall back to the database's own
stamps (deployments/gateway/server.py reloads on either)."""
import logging

from plumbing import redisconn

log = logging.getLogger(__name__)



def version_key() -> str:
    return redisconn.key("gateway", "version")


def channel() -> str:
    return redisconn.channel("gateway", "changed")


def changed(what: str = "keys") -> None:
    """Call after a key, route, alias or deployment state change has been committed."""
    try:
        client = redisconn.client()
        client.incr(version_key())
        client.publish(channel(), what)
    except Exception as exc:  # noqa: BLE001 - the gateways also poll the database
        log.warning("Could not tell the gateways that %s changed: %s", what, exc)


def version() -> int:
    value = redisconn.client().get(version_key())
    return int(value or 0)
