"""Long polls a user may hold at once in this web process: each one holds a web thread while it waits.

Why: WEB_THREADS threads serve every request of the process; one viewer opening 50 long polls
would hold them all and nothing else (not even /healthz) would be answered. Past the per-user
limit, or past half of the threads for everyone together, a long poll answers at once instead
(the client polls again), so the threads left always serve ordinary requests.
"""
import threading
from collections import Counter
from contextlib import contextmanager

from django.conf import settings

_held: Counter = Counter()
_lock = threading.Lock()


@contextmanager
def slot(user_id):
    """Yields True when this request may wait (and holds a slot while it does), False when it must not."""
    with _lock:
        ok = (_held[user_id] < settings.LONG_POLLS_PER_USER
              and sum(_held.values()) < max(1, settings.WEB_THREADS // 2))
        if ok:
            _held[user_id] += 1
    try:
        yield ok
    finally:
        if ok:
            with _lock:
                _held[user_id] -= 1
                if not _held[user_id]:
                    del _held[user_id]
