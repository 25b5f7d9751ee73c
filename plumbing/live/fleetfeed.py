"""The fleet page's live feed, one per web process (per event loop): it scales with the fleet, not
with nodes x browsers.

Every node's sample updates its state (the app's FleetNode, as JSON) in a Redis hash and announces it on
a pub/sub channel (announce(), in the same round trip as the node's own message). A web process listens
once, whatever its number of fleet-page sockets, and at most every LIVE_TICK_S hands each socket one
message with the nodes that changed since that socket's last message (the first change after a quiet
spell goes out at once). Nothing goes through the Channels layer, so no per-channel capacity can drop
it. A socket whose browser reads slowly keeps one pending message that later changes merge into, so it
skips to the latest state instead of queueing; `superseded` counts the node states it skipped. When the
pub/sub connection drops, the feed reads the whole hash again on reconnect and hands it out, so no
change is lost.
"""
import asyncio
import logging
import time
import weakref

import redis
from django.conf import settings

from plumbing import redisconn
from plumbing.live.snapshots import SNAPSHOT_TTL

FLEET = "fleet"  # the topic; its one message kind is "nodes"
log = logging.getLogger(__name__)
_feeds: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FleetFeed]" = weakref.WeakKeyDictionary()
counts = {"messages": 0, "superseded": 0, "resyncs": 0}  # this process's, for /metrics


def fleet_state_key() -> str:
    """Redis hash: node id -> that node's FleetNode (JSON), the fleet page's whole state."""
    return redisconn.key("fleet", "state")


def fleet_channel() -> str:
    """Redis pub/sub channel: "<node id> <FleetNode JSON>" each time a node's state changes; every web
    process's fleet feed coalesces them for its own fleet-page sockets."""
    return redisconn.channel("fleet", "changes")


def stamp(text: str, key: str) -> str:
    """A JSON object's text with `key`: now (epoch seconds) added when LIVE_TRACE is on (perf/fleet_scale.py
    times the fleet feed's stages with it), else the text as it is."""
    return f'{text[:-1]},"{key}":{time.time()}}}' if settings.LIVE_TRACE else text


def announce(node_id: int, fleet_node: str):
    """`also` for publish(): in the node topic's round trip, the node's fleet state (`fleet_node`, its JSON text),
    then its change on the channel."""
    fleet_node = stamp(fleet_node, "pub")

    def to_fleet(pipe):
        pipe.hset(fleet_state_key(), str(node_id), fleet_node)
        pipe.expire(fleet_state_key(), SNAPSHOT_TTL)
        pipe.publish(fleet_channel(), f"{node_id} {fleet_node}")

    return to_fleet


def fleet_state() -> dict[str, str]:
    """Every node's FleetNode as JSON text, by node id (text): the fleet page's snapshot."""
    return {k.decode(): v.decode() for k, v in redisconn.client().hgetall(fleet_state_key()).items()}


def fleet_message(nodes: dict[str, str], snapshot: bool = False) -> str:
    """The WebSocket text of kind "nodes" on fleet from FleetNode JSON texts, without decoding them."""
    body = ",".join(f'"{node_id}":{text}' for node_id, text in nodes.items())
    tail = ',"snapshot":true' if snapshot else ""
    return f'{{"topic":"{FLEET}","kind":"nodes","data":{{"nodes":{{{body}}}}}{tail}}}'


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
                    await self.send_text(text or stamp(fleet_message(nodes), "flushed"))
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
            client = redisconn.listener()
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(fleet_channel())
                await pubsub.get_message(timeout=5)  # the confirmation: from now on nothing passes us by
                self.listening.set()
                if resync:  # changes announced while we were away: the hash has them all
                    counts["resyncs"] += 1
                    for node_id, text in (await client.hgetall(fleet_state_key())).items():
                        self._add(node_id.decode(), text.decode())
                resync = True
                while True:
                    message = await pubsub.get_message(timeout=30)
                    if message is not None:
                        node_id, _, text = message["data"].decode().partition(" ")
                        self._add(node_id, stamp(text, "heard"))
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
                text = stamp(fleet_message(nodes), "flushed")  # one serialization for every socket in step
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
