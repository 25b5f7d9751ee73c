"""Versioned caches for the API's hot reads: list answers and token lookups.

A JSON answer is kept in the web process under its full URL (host included: pagination links are
absolute) and the caller's role, with the version of every table it read. Versions live in Redis:
a database execute wrapper sees every statement, in every process, so each committed INSERT/
UPDATE/DELETE bumps the version of the table it wrote (ORM, bulk update or raw SQL alike; a write
it cannot attribute, such as TRUNCATE, bumps them all), and the SELECTs run while an answer is
computed name the tables it depends on, so no answer is ever served after a change it depends on.
A heartbeat (an UPDATE that sets only the columns in LIVE_COLUMNS) bumps nothing: no kept answer shows
those columns, and the node list reads them, with the telemetry, for each request (LivePart).

A request reads all versions in one Redis round trip; while nothing it depends on changed, the
answer costs no query. After a change, one request per process recomputes an answer and
concurrent ones wait for it instead of each computing it again. Versions only grow: an answer
computed after reading versions V serves any request that found versions <= V. A version that
goes missing (Redis flushed or restarted) starts again from the current time in microseconds,
above any value it had. While Redis cannot be reached, reads skip the cache.

A write whose bump cannot reach Redis (an outage, or Redis back with its data but unreachable when
the write committed) leaves other processes' answers and token checks looking valid: this process
then owes a bump of EVERYTHING, pays it from a retry thread as soon as Redis answers, and serves
nothing from its own cache until then. A new process starts owing one, for a writer that died
before it could pay. So a token revoked during an outage is refused everywhere once Redis is back.
"""
import asyncio
import functools
import logging
import os
import re
import threading
import time
from functools import wraps

import orjson
import redis
from django.apps import apps
from django.db import transaction
from django.db.backends.signals import connection_created
from django.http import HttpResponse
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from plumbing import clientip, redisconn
from plumbing.lru import SizedLRU
from plumbing import tokens as panel_tokens
from plumbing.roles import group_names, is_operator
from plumbing.tokens import digest as token_digest

log = logging.getLogger(__name__)
EVERYTHING = "*"  # bumped by a write whose table cannot be told
# Logins and page visits, and idempotency keys, change no API answer.
UNWATCHED_TABLES = {"django_session", "controlpanel_idempotencykey"}
DEBT_RETRY_S = 0.5  # how often a process that owes a bump tries Redis again
# Columns every agent writes on its own schedule (a heartbeat each 5 s per node): an UPDATE that sets
# only these makes no answer stale, not even those that read the table (a node's name in the deployment
# or copy lists). The node list reads them from Redis (deployments/nodelive.py): a write of them must
# also update or drop the node's entry there.
LIVE_COLUMNS = {"deployments_node": {"last_heartbeat", "disk_total", "disk_free", "ram_total", "cpu_count"}}
MAX_BYTES = 32 * 2**20  # answers kept per web process
MAX_ENTRY = 2 * 2**20
_WRITE_HEADS = ("INSERT", "UPDATE", "DELETE", "REPLACE", "TRUNCATE")
_WRITE_RE = re.compile(r'^\s*(?:INSERT\s+(?:OR\s+\w+\s+)?INTO|REPLACE\s+INTO|UPDATE|DELETE\s+FROM)\s+"?(\w+)"?', re.I)
_ANY_WRITE_RE = re.compile(r"\b(?:INSERT|UPDATE|DELETE|REPLACE|TRUNCATE)\b", re.I)
_READ_RE = re.compile(r'\b(?:FROM|JOIN)\s+"?(\w+)"?', re.I)
_SET_RE = re.compile(r'^\s*UPDATE\s+"?\w+"?\s+SET\s+(.*?)\s+WHERE\s', re.I | re.S)
_SET_COLUMN_RE = re.compile(r'"?(\w+)"?\s*=\s*(?:%s|\?)\s*(?:,|$)')


def _vkey() -> str:
    """The one Redis hash of every version (a field per name): read whole with one HGETALL."""
    return redisconn.key("apiversions")


def _redis():
    return redisconn.client()


@functools.cache
def _all_names() -> tuple:
    """Every version there is (one per table of the project's models, plus EVERYTHING), with
    its field name in Redis' answer."""
    tables = {m._meta.db_table for m in apps.get_models(include_auto_created=True)} - UNWATCHED_TABLES
    return tuple((name, name.encode()) for name in sorted(tables) + [EVERYTHING])


class _Debt:
    """Whether this process owes every other one a bump of EVERYTHING (a write it could not announce)."""

    def __init__(self):
        self.owed = True  # a new process pays one for a writer that died owing it
        self.lock = threading.Lock()
        self.retrying = False
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:  # a prefork worker: no retry thread came along, the lock may have been held
        self.lock = threading.Lock()
        self.retrying = False

    def incur(self) -> None:
        with self.lock:
            self.owed = True
            if self.retrying:
                return
            self.retrying = True
        threading.Thread(target=self._retry, name="apicache-debt", daemon=True).start()

    def pay(self) -> None:
        """Bump EVERYTHING if owed (raises RedisError while Redis is away; the debt stays)."""
        if not self.owed:
            return
        with self.lock:  # held while paying: a reader waits for the bump rather than trust old versions
            if self.owed:
                bump(EVERYTHING, _paying=True)
                self.owed = False

    def _retry(self) -> None:
        while True:
            time.sleep(DEBT_RETRY_S)
            try:
                self.pay()
            except (redis.RedisError, OSError):
                continue
            with self.lock:
                if not self.owed:
                    self.retrying = False
                    return


debt = _Debt()


def bump(*names: str, pipe=None, _paying=False) -> None:
    """Make every cached answer that depends on one of `names` stale (into `pipe` when given)."""
    if not _paying:
        debt.pay()
    target = pipe if pipe is not None else _redis().pipeline()
    start = time.time_ns() // 1000  # a missing version restarts above any value it had before
    for name in names:
        target.hsetnx(_vkey(), name, start)
        target.hincrby(_vkey(), name, 1)
    if pipe is None:
        target.execute()


def versions() -> dict:
    """All current versions (as Redis gives them: digits in bytes), in one round trip; missing
    ones are started."""
    debt.pay()  # before reading: versions that missed a write would vouch for stale answers
    found = _redis().hgetall(_vkey())
    current = by_name(found)
    if current is None:
        bump(*[name for name, field in _all_names() if field not in found])
        current = by_name(_redis().hgetall(_vkey()))
    return current


def by_name(found: dict) -> dict | None:
    """Redis' answer (field -> version) by version name; None while a version is missing."""
    if any(field not in found for _, field in _all_names()):
        return None
    return {name: found[field] for name, field in _all_names()}


def request_versions(request) -> dict:
    """The versions as this request found them (authentication and the answer share one read)."""
    django_request = getattr(request, "_request", request)
    found = getattr(django_request, "_apicache_versions", None)
    if found is None:
        found = django_request._apicache_versions = versions()
    return found


def _snapshot(current: dict, tables: set) -> tuple:
    names = [n for n in tables if n in current] + [EVERYTHING]
    return tuple((n, int(current[n])) for n in names)


def _valid(snapshot: tuple, current: dict) -> bool:
    """Whether an answer computed after reading `snapshot` shows every change `current` counts."""
    return all(value >= int(current[name]) for name, value in snapshot if name in current)


# -- seeing writes and reads ----------------------------------------------------------------------

_reading = threading.local()  # .tables: the set being recorded by this thread, or None


def _bump_quietly(table: str) -> None:
    try:
        bump(table)
    except (redis.RedisError, OSError) as exc:  # a write must not fail for the cache's sake
        debt.incur()
        clear()
        log.warning("could not mark cached API answers stale (%s); this process's cache was cleared and "
                    "every process's will be once Redis answers", exc)


def _watch(execute, sql, params, many, context):
    result = execute(sql, params, many, context)
    head = sql.lstrip()[:8].upper()
    if head.startswith(_WRITE_HEADS) or (not head.startswith("SELECT") and _ANY_WRITE_RE.search(sql)):
        match = _WRITE_RE.match(sql)
        table = match[1] if match else EVERYTHING  # TRUNCATE, WITH ... UPDATE: who knows what changed
        if table not in UNWATCHED_TABLES and not (table in LIVE_COLUMNS and _sets_only(sql, LIVE_COLUMNS[table])):
            _bump_quietly(table)  # now, for readers on this connection (inside the transaction)
            connection = context["connection"]
            if connection.in_atomic_block:  # and once committed, for everyone else
                transaction.on_commit(lambda: _bump_quietly(table), using=connection.alias)
    else:
        tables = getattr(_reading, "tables", None)
        if tables is not None:
            tables.update(_READ_RE.findall(sql))
    return result


def _sets_only(sql: str, columns: set) -> bool:
    """Whether `sql` is an UPDATE that sets nothing but plain parameters into `columns`."""
    found = _SET_RE.match(sql)
    if not found:
        return False
    assignments = found[1].split(",")
    names = [_SET_COLUMN_RE.fullmatch(a.strip() + ",") for a in assignments]
    return all(names) and {n[1] for n in names} <= columns


class _recording:
    """Collect the tables this thread's queries read inside the block."""

    def __enter__(self):
        self.outer = getattr(_reading, "tables", None)
        self.tables = _reading.tables = set()
        return self.tables

    def __exit__(self, *exc):
        _reading.tables = self.outer
        if self.outer is not None:
            self.outer.update(self.tables)


def _on_connection(sender, connection, **kwargs):
    if _watch not in connection.execute_wrappers:
        connection.execute_wrappers.append(_watch)


def watch_database_writes() -> None:
    """Called once per process (AppConfig.ready): every new database connection reports to us."""
    connection_created.connect(_on_connection, dispatch_uid="apicache-watch-writes")


# -- the process-local store --------------------------------------------------------------------

answers = SizedLRU(MAX_BYTES)  # (url, operator?) -> (snapshot, body, content type, composed)
tokens = SizedLRU(10_000)  # key -> (snapshot, (user, token))
values = SizedLRU(64)  # key -> (snapshot, value): cached_value()
_computing: dict = {}  # answer key -> Event, while one thread computes it
_computing_lock = threading.Lock()


def clear() -> None:
    answers.clear()
    tokens.clear()
    values.clear()


def cached_value(key, compute, current: dict | None):
    """`compute()`, kept in this process while no table it read changed. `current`: versions() as the
    caller found them; None (Redis unreachable) computes."""
    if current is None:
        return compute()
    found = values.get(key)
    if found is not None and _valid(found[0], current):
        outer = getattr(_reading, "tables", None)
        if outer is not None:  # an answer cached around this one depends on what this one read
            outer.update(name for name, _ in found[0] if name != EVERYTHING)
        return found[1]
    with _recording() as tables:
        value = compute()
    values.put(key, (_snapshot(current, tables), value), 1)
    return value


class LivePart:
    """Fields of a list answer that change too often to keep it (the node list's heartbeats and samples). The
    kept answer holds the rest; these are read for each request with one Redis script (`script` on
    `keys(answer)`) and merged in, with the same code by Django in its thread (`fill`: what Redis lacks comes
    from the database) and by the fast lane on the loop (`merge`: None when Redis lacks any; Django answers)."""

    script = ""

    def keys(self, answer: dict) -> list[str]:
        raise NotImplementedError

    def merge(self, answer: dict, found: list | None) -> dict | None:
        raise NotImplementedError

    def fill(self, answer: dict, found: list | None) -> dict:
        raise NotImplementedError

    def read(self, answer: dict) -> list | None:
        """Redis' part for `answer`, or None while Redis cannot be reached."""
        keys = self.keys(answer)
        try:
            return _redis().eval(self.script, len(keys), *keys)
        except (redis.RedisError, OSError):
            return None

    async def read_async(self, answer: dict, client) -> list | None:
        """read(), with an asyncio Redis client (the fast lane's)."""
        keys = self.keys(answer)
        try:
            return await client.eval(self.script, len(keys), *keys)
        except (redis.RedisError, OSError, asyncio.TimeoutError):
            return None


def cached_read(live: LivePart | None = None):
    """For a viewset's GET action: serve the JSON answer from the store while what it read holds.

    `live`: the fields the action's answer leaves out, filled in for each request (the node list's telemetry).
    """

    def decorate(action):
        def plain(self, request, *args, **kwargs):
            response = action(self, request, *args, **kwargs)
            if live is not None and response.status_code == 200:
                response.data = live.fill(response.data, live.read(response.data))
            return response

        @wraps(action)
        def wrapper(self, request, *args, **kwargs):
            if request.accepted_renderer.format != "json":
                return plain(self, request, *args, **kwargs)
            try:
                current = request_versions(request)
            except redis.RedisError:
                return plain(self, request, *args, **kwargs)
            key = (request.build_absolute_uri(), is_operator(request.user))
            for _ in range(3):
                hit = _hit(key, current)
                if hit is not None:
                    hit.cache_state = "hit"  # for the Server-Timing header (SERVER_TIMING)
                    return _for_the_lane(hit, request, key)
                with _computing_lock:
                    done = _computing.get(key)
                    leader = done is None
                    if leader:
                        done = _computing[key] = threading.Event()
                if leader:
                    break
                done.wait(30)  # then its answer, unless older than our versions or not cacheable
            try:
                with _recording() as tables:
                    response = action(self, request, *args, **kwargs)
                    if response.status_code == 200:
                        response.accepted_renderer = request.accepted_renderer
                        response.accepted_media_type = request.accepted_media_type
                        response.renderer_context = self.get_renderer_context()
                        response.render()
                if response.status_code == 200:
                    composed = None
                    if live is not None:  # kept without the live part, which each request reads
                        render = functools.partial(request.accepted_renderer.render,
                                                   accepted_media_type=request.accepted_media_type, renderer_context={})
                        composed = (live, orjson.loads(response.content), render)
                    entry = (_snapshot(current, tables), response.content, response["Content-Type"], composed)
                    kept = len(response.content) <= MAX_ENTRY
                    if kept:
                        answers.put(key, entry, len(response.content))
                    if composed is not None:
                        response = _answer(entry[1:])
                    if kept:
                        _for_the_lane(response, request, key)
                response.cache_state = "miss"
                return response
            finally:
                if leader:
                    with _computing_lock:
                        _computing.pop(key, None)
                    done.set()

        return wrapper

    return decorate


def _for_the_lane(response, request, key):
    """Mark an answer served from (or kept in) the store to a caller with an API token: the web handler
    then teaches plumbing.fastlane to serve requests exactly like this one on the event loop."""
    if isinstance(request.successful_authenticator, CachedTokenAuthentication):
        response.cache_key = key
    return response


def cached_answer(key, current: dict):
    """(body, content type, composed) kept under `key` and still valid at `current`, or None. `composed`:
    None, or (LivePart, the answer without it, render) when the body is to be composed for each request."""
    found = answers.get(key)
    if found is None or not _valid(found[0], current):
        return None
    return found[1:]


def _answer(found) -> HttpResponse:
    body, content_type, composed = found
    if composed is not None:
        part, answer, render = composed
        body = render(part.fill(answer, part.read(answer)))
    return HttpResponse(body, content_type=content_type)


def _hit(key, current: dict):
    found = cached_answer(key, current)
    return None if found is None else _answer(found)


def cached_user(raw_key: str, current: dict):
    """The user the token cache vouches for at `current` (no query, no Redis), or None."""
    found = tokens.get(token_digest(raw_key))
    return found[1][0] if found is not None and _valid(found[0], current) else None


class CachedTokenAuthentication(TokenAuthentication):
    """DRF's token check, remembered in the process until a table it read (the token, the user,
    the user's groups) changes: a revoked token or a changed role counts on the next call."""

    def authenticate(self, request):
        self.request = request
        return super().authenticate(request)

    def authenticate_credentials(self, key):
        key = token_digest(key)  # the table holds digests only (plumbing/tokens.py)
        try:
            current = request_versions(self.request)
        except redis.RedisError:
            return super().authenticate_credentials(key)
        found = tokens.get(key)
        if found is not None and _valid(found[0], current):
            return found[1]
        address = clientip.client_address(self.request)
        if panel_tokens.blocked(address):  # guessing tokens: wait for the next minute
            raise exceptions.Throttled(wait=60, detail="Too many wrong API tokens from this address; try again in a minute.")
        with _recording() as tables:
            try:
                user, token = super().authenticate_credentials(key)  # raises for a bad or inactive one
            except exceptions.AuthenticationFailed:
                panel_tokens.failed(address)
                raise
            group_names(user)  # the roles, read now so that they are part of what this depends on
        tokens.put(key, (_snapshot(current, tables), (user, token)), 1)
        return user, token
