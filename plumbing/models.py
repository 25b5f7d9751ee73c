"""Tables of the shared plumbing: what must outlive Redis, which may restart empty."""
from django.db import models
from django.utils import timezone


class IdempotencyKey(models.Model):
    """One API call made under an Idempotency-Key, and its answer, replayed to a retry (plumbing/idempotency.py)."""

    digest = models.CharField(max_length=64, unique=True)  # SHA-256 of the user, the path and the key
    created = models.DateTimeField(default=timezone.now, db_index=True)
    status = models.PositiveSmallIntegerField(null=True)  # None while the first call runs
    body = models.TextField(blank=True)  # the answer's JSON

    def __str__(self):
        return f"{self.digest[:12]}… {self.status or 'running'}"
