"""Whether a request's credential is valid, before Django's middleware runs (plumbing/handler.py asks,
to lift the pre-login body cap only for a real user: a header or a cookie alone can be forged).

Runs in a web thread (it reads the database). A wrong API token counts towards the address's token
throttle like one sent to the API (plumbing/tokens.py), so a large body is no way around it.
"""
import logging
from importlib import import_module
from types import SimpleNamespace

import redis
from django.conf import settings
from django.db import close_old_connections
from django.http import parse_cookie

from plumbing import tokens

log = logging.getLogger(__name__)


def valid(headers: dict[bytes, bytes], address: str) -> bool:
    """True when the ASGI `headers` carry a valid API token (`Authorization: Token ...`) of an active
    user, or the session cookie of a logged-in active user."""
    try:
        return _valid(headers, address)
    finally:
        # Outside a request's signals (a refused body never gets one): recycle the thread's connection
        # as request_finished would (CONN_MAX_AGE), or it stays open until the thread's next request.
        close_old_connections()


def _valid(headers: dict[bytes, bytes], address: str) -> bool:
    authorization = headers.get(b"authorization", b"").decode("latin-1").split()
    if len(authorization) == 2 and authorization[0].lower() == "token":
        return _token_valid(authorization[1], address)
    key = parse_cookie(headers.get(b"cookie", b"").decode("latin-1")).get(settings.SESSION_COOKIE_NAME)
    if not key:
        return False
    from django.contrib.auth import get_user  # models: importable only once Django is set up

    store = import_module(settings.SESSION_ENGINE).SessionStore(key)
    return get_user(SimpleNamespace(session=store)).is_authenticated  # the session's hash and is_active checked


def _token_valid(raw: str, address: str) -> bool:
    from rest_framework.authtoken.models import Token

    try:
        if tokens.blocked(address):
            return False
    except redis.RedisError:
        pass  # as the API's own check: no throttle while Redis is away
    if Token.objects.filter(key=tokens.digest(raw), user__is_active=True).exists():
        return True
    try:
        tokens.failed(address)
    except redis.RedisError:
        log.warning("cannot count a wrong API token from %s: Redis is away", address)
    return False
