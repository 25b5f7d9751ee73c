"""The one WebSocket consumer: authenticates, joins topic groups, forwards.

No database access per message: the role is checked on connect, on a timer (WS_RECHECK_SECONDS)
and when logout or a role change nudges the socket (plumbing/live/access.py); a subscribe checks
once that its objects exist (the topic registry, plumbing/live/topics.py).

Every LIVE_HEARTBEAT_S the socket sends itself a heartbeat through the layer, to a group only it is
in, and forwards it: the browser sees beats only while the layer still knows the socket's groups.
Redis restarted empty (or flushed) forgets them all and nothing else would tell; the browser then
reconnects, which joins the groups again and sends each topic's snapshot (static/panel/live.js).
"""
import asyncio

import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from plumbing.live import access, fleetfeed, snapshots, topics

MAX_TOPICS = 100  # per socket: a page needs a handful; this bounds what one socket can make the server track


async def beat(layer, channel_name: str, every: float) -> None:
    """A socket's heartbeat, through the layer as updates go: it arrives only while the layer still holds
    the socket's groups, which Redis restarted empty (or flushed) forgets without a word."""
    try:
        event = {"type": "live.beat", "every": every}
        await asyncio.wait_for(layer.group_send(topics.socket_group(channel_name), event), 5)
    except (redis.RedisError, OSError, TimeoutError):
        pass  # the browser notices the missing beat


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Browser sends {"subscribe": [topics]} / {"unsubscribe": [topics]}; gets snapshots then deltas."""

    async def connect(self):
        user = self.scope.get("user")
        session = self.scope.get("session")
        self.user_id = user.pk if user is not None and user.is_authenticated else None
        self.session_key = getattr(session, "session_key", None)
        # Close with 4401/4403 so the browser helper knows not to retry forever.
        code = await database_sync_to_async(access.close_code)(self.user_id, self.session_key)
        if code:
            await self.close(code=code)
            return
        self.topics = set()
        self.fleet = None  # fleetfeed.Subscriber while the socket watches the fleet page
        self.groups_joined = [topics.user_group(self.user_id), topics.socket_group(self.channel_name)] + (
            [topics.session_group(self.session_key)] if self.session_key else [])
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        self.timer = asyncio.create_task(self._recheck_every(settings.WS_RECHECK_SECONDS))
        self.beats = asyncio.create_task(self._beat_every(settings.LIVE_HEARTBEAT_S))

    async def disconnect(self, code):
        for task in (getattr(self, "timer", None), getattr(self, "beats", None)):
            if task:
                task.cancel()
        self._leave_fleet()
        for group in getattr(self, "groups_joined", []):
            await self.channel_layer.group_discard(group, self.channel_name)
        for topic in getattr(self, "topics", set()):
            await self.channel_layer.group_discard(topics.group_name(topic), self.channel_name)

    async def _recheck_every(self, seconds: float):
        while True:
            await asyncio.sleep(seconds)
            await self.session_recheck({})

    async def _beat_every(self, seconds: float):
        while True:
            await asyncio.sleep(seconds)
            await beat(self.channel_layer, self.channel_name, seconds)

    async def live_beat(self, event):
        await self.send_json({"beat": event["every"]})

    async def session_recheck(self, event):
        code = await database_sync_to_async(access.close_code)(self.user_id, self.session_key)
        if code:
            await self.close(code=code)

    async def session_end(self, event):
        await self.close(code=4401)

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict):
            return
        wanted = content.get("subscribe", [])
        wanted = [t for t in wanted[:50] if topics.valid_topic(t)] if isinstance(wanted, list) else []
        exists = await database_sync_to_async(topics.existing)(wanted) if wanted else set()
        for topic in (content.get("subscribe") if isinstance(content.get("subscribe"), list) else [])[:50]:
            if topic not in exists:
                await self.send_json({"error": f"unknown topic {str(topic)[:80]!r}"})
                continue
            if topic not in self.topics and len(self.topics) >= MAX_TOPICS:
                await self.send_json({"error": f"at most {MAX_TOPICS} topics per connection"})
                break
            await self.channel_layer.group_add(topics.group_name(topic), self.channel_name)
            self.topics.add(topic)
            for message in await database_sync_to_async(snapshots.on_subscribe)(topic):
                await self.send_json({**message, "snapshot": True})
            if topic == fleetfeed.FLEET and self.fleet is None:
                # Join the feed first, then read the state: a change in between comes twice, never
                # not at all (the page keeps each node's newest sample time).
                self.fleet = fleetfeed.Subscriber(self._send_text)
                await fleetfeed.feed().join(self.fleet)
                state = await database_sync_to_async(fleetfeed.fleet_state)()
                await self.send(text_data=fleetfeed.fleet_message(state, snapshot=True))
        unsubscribe = content.get("unsubscribe", [])
        for topic in (unsubscribe if isinstance(unsubscribe, list) else [])[:50]:
            if topic in self.topics:
                await self.channel_layer.group_discard(topics.group_name(topic), self.channel_name)
                self.topics.discard(topic)
                if topic == fleetfeed.FLEET:
                    self._leave_fleet()

    def _leave_fleet(self):
        if getattr(self, "fleet", None) is not None:
            fleetfeed.feed().leave(self.fleet)
            self.fleet = None

    async def _send_text(self, text: str):
        await self.send(text_data=text)

    async def live_message(self, event):
        await self.send_json(event["message"])
