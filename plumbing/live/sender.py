"""group_send from sync code (services, tasks, the agent), on one event loop per process kept for it."""
import asyncio
import logging
import os
import threading

import redis
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)
_sender: dict = {"pid": None, "loop": None}
_sender_lock = threading.Lock()


def _sender_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for sends from sync code (started on first use, again in a forked child)."""
    with _sender_lock:
        if _sender["pid"] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="live-sender", daemon=True).start()
            _sender.update(pid=os.getpid(), loop=loop)
        return _sender["loop"]


def group_send(group: str, event: dict, what: str) -> None:
    """group_send from sync code, on one event loop per process kept for it: its Redis connections stay
    open (async_to_sync made a thread, a loop and a new connection for every message, ~1 ms each for
    each of a fleet's samples), and a caller whose thread runs a loop (ORM signals in async code,
    Playwright's sync API in the tests) is served the same way."""
    future = asyncio.run_coroutine_threadsafe(get_channel_layer().group_send(group, event), _sender_loop())
    try:
        future.result(5)
    except (redis.RedisError, OSError, TimeoutError) as exc:
        future.cancel()
        log.warning("live %s not sent: %s", what, exc or "timed out")
