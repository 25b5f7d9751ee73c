"""Cached API answers served on the event loop: no thread hop, no middleware, no view.

A cache hit through Django costs about 0.6 ms of CPU more than the health check, most of it the hop to a
request thread and the middleware and DRF dispatch around a lookup that takes microseconds. So when Django
answers a GET from plumbing.apicache for a caller holding an API token, the web handler teaches this lane
what that request looked like: everything in it but the token (scheme, path, query and every other header),
the headers Django's middleware gave the answer, and the role of the caller it was served to. The next
request exactly alike is answered here, from the same cache entry, when

- its token is one the token cache still vouches for, and its user has a role Django served this request to
  (the permission classes decided by role, so the same role gets the same decision);
- the versions, read from Redis without blocking the loop, show that nothing the token check or the answer
  read has changed since (the same validity rule as plumbing.apicache).

Anything else (a request never seen alike, a stale entry, another role, a cookie, a body, Redis away, a
process that owes a bump) goes the usual way: Django in a thread answers it, and teaches the lane again.
So the lane answers only what Django would answer the same way at that moment.
"""
import asyncio
import time
import weakref

import redis
from django.conf import settings
from redis import asyncio as aioredis

from plumbing import apicache
from plumbing.lru import SizedLRU
from plumbing.roles import is_operator, role_name

_KEYWORD = b"Token "
_NOT_FOR_THE_LANE = {b"cookie", b"content-length", b"transfer-encoding"}  # a session, or a body
_DROPPED = {"content-length", "server-timing"}  # recomputed for each answer
learned = SizedLRU(4096)  # request shape -> (absolute URI, headers, roles served)
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its asyncio Redis client


def shape(scope) -> tuple:
    """(what in the request decides Django's answer but its token, the token), or (None, None) when the
    request is not one the lane serves: not a GET under /api/, no token, two of them, a cookie or a body."""
    if scope.get("method") != "GET" or not scope.get("path", "").startswith("/api/"):
        return None, None
    token, rest = None, []
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            if token is not None or not value.startswith(_KEYWORD):
                return None, None
            token = value[len(_KEYWORD):]
        elif name in _NOT_FOR_THE_LANE:
            return None, None
        else:
            rest.append((name, value))
    if not token or token.split() != [token] or not token.isascii():
        return None, None
    return (scope.get("scheme", "http"), scope.get("root_path", ""), scope["path"], scope.get("query_string", b""),
            tuple(rest)), token.decode()


def learn(scope, request, response) -> None:
    """After Django answered `request` (in its thread): remember it if it came from the answer cache."""
    key = getattr(response, "cache_key", None)  # set by apicache.cached_read for a caller with a token
    if key is None or response.status_code != 200 or response.streaming or response.cookies:
        return
    found, _ = shape(scope)
    if found is None:
        return
    role = role_name(request.user)
    before = learned.get(found)
    roles = (before[2] if before is not None and before[0] == key[0] else frozenset()) | {role}
    headers = tuple((name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()
                    if name.lower() not in _DROPPED)
    learned.put(found, (key[0], headers, roles), 1)


def _client():
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return client


async def _versions() -> dict | None:
    """The versions, read without blocking the loop; None when they cannot vouch for anything now."""
    if apicache.debt.owed:
        return None
    try:
        found = await _client().hgetall(apicache._vkey())
    except (redis.RedisError, OSError, asyncio.TimeoutError):
        return None
    return apicache.by_name(found)  # None while one is missing: Django's path starts it


async def serve(scope, send) -> bool:
    """Answer the request here if the lane may; False: it did not, Django must."""
    started = time.perf_counter()
    found, token = shape(scope)
    entry = learned.get(found) if found is not None else None
    if entry is None:
        return False
    uri, headers, roles = entry
    current = await _versions()
    user = apicache.cached_user(token, current) if current is not None else None
    if user is None or not user.is_active or role_name(user) not in roles:
        return False
    answer = apicache.cached_answer((uri, is_operator(user)), current)
    if answer is None:
        return False
    body, _, composed = answer
    if composed is not None:  # the node list: its live part read now, as Django would (apicache.LivePart)
        part, kept, render = composed
        merged = part.merge(kept, await part.read_async(kept, _client()))
        if merged is None:  # a node Redis does not hold, or Redis away
            return False
        body = render(merged)
    headers = headers + ((b"content-length", str(len(body)).encode()),)
    if settings.SERVER_TIMING:
        headers += ((b"server-timing", f"lane;dur={(time.perf_counter() - started) * 1000:.2f}, cache;desc=lane".encode()),)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
    return True
