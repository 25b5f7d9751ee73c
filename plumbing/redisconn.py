"""The panel's plain Redis connection (live snapshots, telemetry history, API cache versions,
token throttling) and the one place that prefixes its keys."""
import redis
from django.conf import settings

_client = None


def client() -> redis.Redis:
    """One connection pool per process."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL)
    return _client


def key(*parts) -> str:
    """`<prefix>:part:part`; the prefix is the Channels one, so tests and panels sharing a Redis stay apart."""
    return ":".join([settings.CHANNEL_LAYERS["default"]["CONFIG"].get("prefix", "panel"), *map(str, parts)])


def channel(*parts) -> str:
    """A pub/sub channel name: like key(), plus the database number, since pub/sub channels are global
    to the Redis server (two panels on one Redis with different databases would hear each other)."""
    return key(*parts, f"db{client().connection_pool.connection_kwargs.get('db', 0)}")
