"""The panel's plain Redis connection (live snapshots, telemetry history, API cache versions,
token throttling), the fleet feed's pub/sub connections, and the one place that prefixes keys and channels."""
import redis
import redis.asyncio as aioredis
from django.conf import settings

_client = None


def client() -> redis.Redis:
    """One connection pool per process."""
    global _client
    if _client is None:
        _client = redis.Redis.from_url(settings.REDIS_URL)
    return _client


def listener() -> aioredis.Redis:
    """A new asyncio client for a pub/sub listener in an event loop (plumbing/live/fleetfeed.py): a subscribed
    connection can run nothing else, and an asyncio connection belongs to its loop, so client()'s pool can't
    serve it."""
    return aioredis.Redis.from_url(settings.REDIS_URL)


def key(*parts) -> str:
    """`<prefix>:part:part`; the prefix is the Channels one, so tests and panels sharing a Redis stay apart."""
    return ":".join([settings.CHANNEL_LAYERS["default"]["CONFIG"].get("prefix", "panel"), *map(str, parts)])


def channel(*parts) -> str:
    """A pub/sub channel name: like key(), plus the database number, since pub/sub channels are global
    to the Redis server (two panels on one Redis with different databases would hear each other)."""
    return key(*parts, f"db{client().connection_pool.connection_kwargs.get('db', 0)}")
