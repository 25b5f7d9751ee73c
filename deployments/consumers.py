"""The one WebSocket consumer: authenticates, joins topic groups, forwards. No database access."""
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlpanel.roles import is_viewer
from deployments import live


class LiveConsumer(AsyncJsonWebsocketConsumer):
    """Browser sends {"subscribe": [topics]} / {"unsubscribe": [topics]}; gets snapshots then deltas."""

    async def connect(self):
        user = self.scope.get("user")
        # Close with 4401/4403 so the browser helper knows not to retry forever.
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not await database_sync_to_async(is_viewer)(user):
            await self.close(code=4403)
            return
        self.topics = set()
        await self.accept()

    async def disconnect(self, code):
        for topic in getattr(self, "topics", set()):
            await self.channel_layer.group_discard(live.group_name(topic), self.channel_name)

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict):
            return
        for topic in content.get("subscribe", [])[:50]:
            if not isinstance(topic, str) or not live.valid_topic(topic):
                await self.send_json({"error": f"unknown topic {str(topic)[:80]!r}"})
                continue
            await self.channel_layer.group_add(live.group_name(topic), self.channel_name)
            self.topics.add(topic)
            for message in await database_sync_to_async(live.snapshot)(topic):
                await self.send_json({**message, "snapshot": True})
        for topic in content.get("unsubscribe", [])[:50]:
            if topic in self.topics:
                await self.channel_layer.group_discard(live.group_name(topic), self.channel_name)
                self.topics.discard(topic)

    async def live_message(self, event):
        await self.send_json(event["message"])
