"""The fleet page's live feed, one per web process (per event loop): it scales with the fleet, not
with nodes x browsers.

Every node's sample updates its FleetNode in a Redis hash and announces it on a pub/sub channel
(deployments/live.py). A web process listens once, whatever its number of fleet-page sockets, and
at most every LIVE_TICK_S hands each socket one message with the nodes that changed since that
socket's last message (the first change after a quiet spell goes out at once). Nothing goes through
the Channels layer, so no per-channel capacity can drop it. A socket whose browser reads slowly
keeps one pending message that later changes merge into, so it skips to the latest state instead
of queueing; `superseded` counts the node states it skipped. When the pub/sub connection drops,
the feed reads the whole hash again on reconnect and hands it out, so no change is lost.
"""
import asyncio
import logging
import weakref

import redis
import redis.asyncio as aioredis
from django.conf import settings

from deployments import live

log = logging.getLogger(__name__)
_feeds: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FleetFeed]" = weakref.WeakKeyDictionary()
counts = {"messages": 0, "superseded": 0, "resyncs": 0}  # this process's, for /metrics


class Subscriber:
    """One socket's pending fleet message: node id -> FleetNode JSON, merged until it is sent."""

    def __init__(self, send_text):
        self.send_text = send_text  # async (text) -> None
        self.pending: dict[str, str] = {}
        self.shared_text: str | None = None  # the tick's own text while pending is exactly that tick
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self._pump())

    def offer(self, nodes: dict[str, str], text: str) -> None:
        if self.pending:
            counts["superseded"] += sum(1 for k in nodes if k in self.pending)
            self.pending.update(nodes)
            self.shared_text = None
        else:
            self.pending, self.shared_text = dict(nodes), text
        self.wake.set()

    async def _pump(self):
        while True:
            await self.wake.wait()
            self.wake.clear()
            nodes, text = self.pending, self.shared_text
            self.pending, self.shared_text = {}, None
            if nodes:
                counts["messages"] += 1
                try:
                    await self.send_text(text or live.stamp(live.fleet_message(nodes), "flushed"))
                except Exception:  # noqa: BLE001 - the socket is gone; its consumer's disconnect cleans up
                    log.debug("fleet feed: send failed", exc_info=True)
                    return

    def close(self):
        self.task.cancel()


class FleetFeed:
    """Listens to the fleet channel while this loop has fleet-page sockets; coalesces per tick."""

    def __init__(self):
        self.subscribers: set[Subscriber] = set()
        self.pending: dict[str, str] = {}
        self.dirty = asyncio.Event()
        self.listening = asyncio.Event()  # set while subscribed to the channel
        self.tasks: list[asyncio.Task] = []

    async def join(self, subscriber: Subscriber) -> None:
        """Add a socket; returns once the feed hears every change from now on, so that a state read
        after this misses none (or after 5 s with Redis away: the reconnect resyncs)."""
        self.subscribers.add(subscriber)
        if not self.tasks:
            self.tasks = [asyncio.create_task(self._listen()), asyncio.create_task(self._flush_every_tick())]
        try:
            await asyncio.wait_for(self.listening.wait(), 5)
        except asyncio.TimeoutError:
            pass

    def leave(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)
        subscriber.close()
        if not self.subscribers:
            for task in self.tasks:
                task.cancel()
            self.tasks = []
            self.listening.clear()
            self.pending = {}

    def _add(self, node_id: str, text: str) -> None:
        self.pending[node_id] = text
        self.dirty.set()

    async def _listen(self):
        resync = False
        while True:
            client = aioredis.Redis.from_url(settings.REDIS_URL)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(live.fleet_channel())
                await pubsub.get_message(timeout=5)  # the confirmation: from now on nothing passes us by
                self.listening.set()
                if resync:  # changes announced while we were away: the hash has them all
                    counts["resyncs"] += 1
                    for node_id, text in (await client.hgetall(live.fleet_state_key())).items():
                        self._add(node_id.decode(), text.decode())
                resync = True
                while True:
                    message = await pubsub.get_message(timeout=30)
                    if message is not None:
                        node_id, _, text = message["data"].decode().partition(" ")
                        self._add(node_id, live.stamp(text, "heard"))
            except (redis.RedisError, OSError) as exc:
                self.listening.clear()
                log.warning("fleet feed: Redis connection lost (%s); resyncing", exc)
                await asyncio.sleep(1)
            finally:
                try:
                    await pubsub.aclose()
                    await client.aclose()
                except (redis.RedisError, OSError):
                    pass

    async def _flush_every_tick(self):
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            nodes, self.pending = self.pending, {}
            if nodes and self.subscribers:
                text = live.stamp(live.fleet_message(nodes), "flushed")  # one serialization for every socket in step
                for subscriber in self.subscribers:
                    subscriber.offer(nodes, text)
            await asyncio.sleep(settings.LIVE_TICK_S)


def feed() -> FleetFeed:
    """This event loop's feed (tests run several loops in one process)."""
    loop = asyncio.get_running_loop()
    found = _feeds.get(loop)
    if found is None:
        found = _feeds[loop] = FleetFeed()
    return found
