"""Idempotency keys for API calls that start work.

A client that sends `Idempotency-Key: <key>` with a POST gets the first answer again when it
retries with the same key (header `Idempotent-Replayed: true`), and 409 while the first call is
still running; keys are per user and kept 24 hours in Redis. Without the header, nothing changes.
"""
import functools
import hashlib
import json

from rest_framework import status
from rest_framework.response import Response

from controlpanel import redisconn

TTL_S = 24 * 3600
PENDING = "pending"


def _redis():
    return redisconn.client()


def idempotent(view):
    @functools.wraps(view)
    def wrapper(self, request, *args, **kwargs):
        key = request.headers.get("Idempotency-Key", "")
        if not key:
            return view(self, request, *args, **kwargs)
        if len(key) > 200 or not key.isprintable():
            return Response({"error": {"code": "invalid", "message": "Idempotency-Key: at most 200 printable characters.",
                                       "fields": {"Idempotency-Key": ["invalid"]}}}, status=status.HTTP_400_BAD_REQUEST)
        digest = hashlib.sha256(f"{request.user.pk}:{request.path}:{key}".encode()).hexdigest()
        slot = f"idempotency:{digest}"
        client = _redis()
        if not client.set(slot, PENDING, nx=True, ex=TTL_S):
            stored = client.get(slot)
            if stored is None or stored.decode() == PENDING:
                return Response({"error": {"code": "in_progress", "message": "A request with this Idempotency-Key is still running.",
                                           "fields": {}}}, status=status.HTTP_409_CONFLICT)
            saved = json.loads(stored)
            return Response(saved["body"], status=saved["status"], headers={"Idempotent-Replayed": "true"})
        try:
            response = view(self, request, *args, **kwargs)
        except Exception:
            client.delete(slot)  # an exception answer is produced later by DRF; let a retry run again
            raise
        if response.status_code >= 500:
            client.delete(slot)
        else:
            client.set(slot, json.dumps({"status": response.status_code, "body": response.data}, default=str), ex=TTL_S)
        return response

    return wrapper
