"""Versioned caches for the API's hot reads: list answers and token lookups.

A JSON answer is kept in the web process under its full URL (host included: pagination links are
absolute) and the caller's role, plus a version read from Redis: "data", which every committed write to the database bumps (a database execute wrapper
sees every INSERT/UPDATE/DELETE, whether from the ORM, a bulk update or another process), and,
for answers that carry telemetry, "live", which each new sample bumps (history.push). A read
costs one Redis round trip while nothing changed; the first read after any change is fresh.
A version that goes missing (Redis flushed or restarted) starts again from a random value, so an
old entry can never match it. While Redis cannot be reached, reads skip the cache.
"""
import logging
import secrets
import threading
from collections import OrderedDict
from functools import wraps

import redis
from django.conf import settings
from django.db import transaction
from django.db.backends.signals import connection_created
from django.http import HttpResponse
from rest_framework.authentication import TokenAuthentication

from controlpanel.roles import is_operator

log = logging.getLogger(__name__)
DATA, LIVE = "data", "live"
ALL = (DATA, LIVE)
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLAC", "TRUNCA")
UNWATCHED_TABLES = ("django_session",)  # logins and page visits change no API answer
MAX_BYTES = 32 * 2**20  # per web process
MAX_ENTRY = 2 * 2**20


def _key(kind: str) -> str:
    return f"{settings.CHANNEL_LAYERS['default']['CONFIG'].get('prefix', 'panel')}:apiversion:{kind}"


def _redis():
    from deployments import live

    return live.redis_client()


def bump(kind: str = DATA, pipe=None) -> None:
    """Make every cached answer that depends on `kind` stale (into `pipe` when given)."""
    target = pipe if pipe is not None else _redis().pipeline()
    target.set(_key(kind), secrets.randbits(48), nx=True)
    target.incr(_key(kind))
    if pipe is None:
        target.execute()


def versions(kinds: tuple[str, ...]) -> tuple:
    values = _redis().mget([_key(k) for k in kinds])
    if None in values:
        for kind, value in zip(kinds, values):
            if value is None:
                bump(kind)
        values = _redis().mget([_key(k) for k in kinds])
    return tuple(values)


def request_versions(request) -> tuple:
    """The versions (DATA, LIVE), read once per request (authentication and the answer share them)."""
    django_request = getattr(request, "_request", request)
    found = getattr(django_request, "_apicache_versions", None)
    if found is None:
        found = django_request._apicache_versions = versions(ALL)
    return found


# -- seeing writes ------------------------------------------------------------------------------

def _bump_quietly() -> None:
    try:
        bump()
    except redis.RedisError as exc:  # a write must not fail for the cache's sake
        answers.clear()
        log.warning("could not mark cached API answers stale (%s); this process's cache was cleared", exc)


def _watch_writes(execute, sql, params, many, context):
    result = execute(sql, params, many, context)
    head = sql.lstrip()[:6].upper()
    if head in WRITES and not any(t in sql[:80] for t in UNWATCHED_TABLES):
        _bump_quietly()  # now, for readers on this connection (inside the transaction)
        connection = context["connection"]
        if connection.in_atomic_block:  # and once committed, for everyone else
            transaction.on_commit(_bump_quietly, using=connection.alias)
    return result


def _on_connection(sender, connection, **kwargs):
    if _watch_writes not in connection.execute_wrappers:
        connection.execute_wrappers.append(_watch_writes)


def watch_database_writes() -> None:
    """Called once per process (AppConfig.ready): every new database connection reports writes."""
    connection_created.connect(_on_connection, dispatch_uid="apicache-watch-writes")


# -- the process-local store --------------------------------------------------------------------

class _Store:
    """A small LRU bounded by size; entries of old versions simply age out."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.size = max_bytes, 0
        self.entries: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            value = self.entries.get(key)
            if value is not None:
                self.entries.move_to_end(key)
            return value

    def put(self, key, value, size: int) -> None:
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = (value, size)
            self.size += size
            while self.size > self.max_bytes and self.entries:
                _, (_, dropped) = self.entries.popitem(last=False)
                self.size -= dropped

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.size = 0


answers = _Store(MAX_BYTES)
tokens = _Store(10_000)  # counted in entries


def clear() -> None:
    answers.clear()
    tokens.clear()


def cached_read(live: bool = False):
    """For a viewset's GET action: serve the JSON answer from the store while its version holds."""
    kinds = (DATA, LIVE) if live else (DATA,)  # a prefix of ALL

    def decorate(action):
        @wraps(action)
        def wrapper(self, request, *args, **kwargs):
            if request.accepted_renderer.format != "json":
                return action(self, request, *args, **kwargs)
            try:
                key = (request_versions(request)[:len(kinds)], request.build_absolute_uri(), is_operator(request.user))
            except redis.RedisError:
                return action(self, request, *args, **kwargs)
            hit = answers.get(key)
            if hit is not None:
                body, content_type = hit[0]
                return HttpResponse(body, content_type=content_type)
            response = action(self, request, *args, **kwargs)
            if response.status_code == 200:
                response.accepted_renderer = request.accepted_renderer
                response.accepted_media_type = request.accepted_media_type
                response.renderer_context = self.get_renderer_context()
                response.render()
                if len(response.content) <= MAX_ENTRY:
                    answers.put(key, (response.content, response["Content-Type"]), len(response.content))
            return response

        return wrapper

    return decorate


class CachedTokenAuthentication(TokenAuthentication):
    """DRF's token check, remembered in the process until the next database write (a revoked
    token or a changed role is a write), so most API calls cost no authentication query."""

    def authenticate(self, request):
        self.request = request
        return super().authenticate(request)

    def authenticate_credentials(self, key):
        try:
            cache_key = (request_versions(self.request)[0], key)
        except redis.RedisError:
            return super().authenticate_credentials(key)
        hit = tokens.get(cache_key)
        if hit is not None:
            return hit[0]
        found = super().authenticate_credentials(key)  # raises for a bad or inactive one
        tokens.put(cache_key, found, 1)
        return found
