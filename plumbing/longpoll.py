"""Long polls a user may hold at once in this web process: each one holds a web thread while it waits.

Why: WEB_THREADS threads serve every request of the process; one viewer opening 50 long polls
would hold them all and nothing else (not even /healthz) would be answered. Past the per-user
limit, or past half of the threads for everyone together, a long poll answers at once instead
(the client polls again), so the threads left always serve ordinary requests.

When the server is told to stop (Ctrl-C, SIGTERM), every long poll answers at once: uvicorn gives open requests a few
seconds, then cancels them with an error, and a poll waits up to 30 s (`lifespan` below, `pause`).
"""
import signal
import threading
from collections import Counter
from contextlib import contextmanager

from django.conf import settings

_held: Counter = Counter()
_lock = threading.Lock()
_stopping = threading.Event()


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


def pause(seconds: float) -> bool:
    """Sleep between a long poll's looks; True when the server is stopping (answer now)."""
    return _stopping.wait(seconds)


async def lifespan(scope, receive, send):
    """The ASGI lifespan: once the server has installed its stop signals' handlers, each also ends the long polls."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if threading.current_thread() is threading.main_thread():  # a server in a thread has no signals
                for sig in (signal.SIGINT, signal.SIGTERM):
                    _chain(sig, signal.getsignal(sig))
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _chain(sig, handler) -> None:
    if callable(handler):

        def stopping(signum, frame):
            _stopping.set()
            handler(signum, frame)

        signal.signal(sig, stopping)
