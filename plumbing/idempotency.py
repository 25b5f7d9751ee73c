"""Idempotency keys for API calls that start work.

A client that sends `Idempotency-Key: <key>` with a POST gets the first answer again when it
retries with the same key (header `Idempotent-Replayed: true`), and 409 while the first call is
still running; keys are per user and kept 24 hours. Without the header, nothing changes.

Keys live in the database, not Redis: a retry after Redis restarted empty (compose and the
embedded Redis keep nothing on disk) must still find the first call, or it would create a second
deployment. The key's row is committed before the call runs, so a concurrent retry meets the
unique index and waits its turn (409) rather than running the call twice. A row still without an answer
after PENDING is a call whose process died between the claim and the answer (a web worker killed or
restarted): the next retry takes the row over and runs the call, instead of answering 409 for a day.
The row's `created` names the claim, so a first call that does finish late cannot overwrite the answer of
the one that took over.
"""
import functools
import hashlib
import json
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone
from rest_framework import status
from rest_framework.response import Response

from plumbing.models import IdempotencyKey

TTL = timedelta(hours=24)
PENDING = timedelta(seconds=60)  # longer than any API call that starts work takes; then its process is gone


def _error(code: str, message: str, http_status: int, fields: dict | None = None) -> Response:
    return Response({"error": {"code": code, "message": message, "fields": fields or {}}}, status=http_status)


def _claim(digest: str) -> IdempotencyKey | None:
    """The row for `digest` this call owns: new, or taken over from a call that left no answer for PENDING;
    None when a call with it already ran or runs (keys past TTL are gone)."""
    now = timezone.now()
    IdempotencyKey.objects.filter(created__lt=now - TTL).delete()
    try:
        with transaction.atomic():
            return IdempotencyKey.objects.create(digest=digest, created=now)
    except IntegrityError:
        pass
    # One UPDATE with the condition: of two retries at once, only one takes the row (the other then sees it fresh).
    if IdempotencyKey.objects.filter(digest=digest, status=None, created__lt=now - PENDING).update(created=now):
        return IdempotencyKey.objects.filter(digest=digest, created=now).first()
    return None


def _mine(row: IdempotencyKey):
    """The row while this call still owns it (not taken over since)."""
    return IdempotencyKey.objects.filter(pk=row.pk, created=row.created)


def idempotent(view):
    @functools.wraps(view)
    def wrapper(self, request, *args, **kwargs):
        key = request.headers.get("Idempotency-Key", "")
        if not key:
            return view(self, request, *args, **kwargs)
        if len(key) > 200 or not key.isprintable():
            return _error("invalid", "Idempotency-Key: at most 200 printable characters.", status.HTTP_400_BAD_REQUEST,
                          {"Idempotency-Key": ["invalid"]})
        digest = hashlib.sha256(f"{request.user.pk}:{request.path}:{key}".encode()).hexdigest()
        row = _claim(digest)
        if row is None:
            stored = IdempotencyKey.objects.filter(digest=digest).first()
            if stored is None or stored.status is None:
                return _error("in_progress", "A request with this Idempotency-Key is still running.",
                              status.HTTP_409_CONFLICT)
            return Response(json.loads(stored.body), status=stored.status, headers={"Idempotent-Replayed": "true"})
        try:
            response = view(self, request, *args, **kwargs)
        except Exception:
            _mine(row).delete()  # an exception answer is produced later by DRF; let a retry run again
            raise
        if response.status_code >= 500:
            _mine(row).delete()
        else:
            _mine(row).update(status=response.status_code, body=json.dumps(response.data, default=str))
        return response

    return wrapper
