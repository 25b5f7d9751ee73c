"""API tokens are stored hashed: the key is shown once when issued and only its digest is kept.

DRF's Token table keeps its shape (one token per user, 40-character key); the key column holds
the SHA-256 digest of the token, so a database dump or the admin's token list gives nobody a
usable token. Tokens are long random strings, so a fast hash is enough (no password stretching).
"""
import hashlib
import secrets
import time

from django.conf import settings
from rest_framework.authtoken.models import Token

from plumbing import redisconn

PREFIX = "pct_"  # lets secret scanners and people recognise a panel token


def digest(raw: str) -> str:
    """What the Token table stores for `raw` (40 hex characters, the key column's size)."""
    return hashlib.sha256(raw.encode()).hexdigest()[:40]


def issue(user) -> str:
    """Replace the user's token with a new one; return it (the only time it is known)."""
    raw = PREFIX + secrets.token_urlsafe(32)
    Token.objects.filter(user=user).delete()
    Token.objects.create(user=user, key=digest(raw))
    return raw


# --- throttling of wrong tokens ------------------------------------------------------------------

def _failures_key(address: str) -> str:
    return redisconn.key("token-failures", address, int(time.time() // 60))


def blocked(address: str) -> bool:
    """True when `address` sent more wrong tokens this minute than TOKEN_FAILURES_PER_MINUTE."""
    return int(redisconn.client().get(_failures_key(address)) or 0) >= settings.TOKEN_FAILURES_PER_MINUTE


def failed(address: str) -> None:
    """Count one wrong token from `address` (kept two minutes)."""
    pipe = redisconn.client().pipeline()
    pipe.incr(_failures_key(address))
    pipe.expire(_failures_key(address), 120)
    pipe.execute()
