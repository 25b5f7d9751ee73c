"""WebSocket routes. Every consumer refuses anonymous users (see plumbing.live.consumer)."""
from django.urls import path

from plumbing.live import consumer

websocket_urlpatterns = [
    path("ws/live/", consumer.LiveConsumer.as_asgi()),
]
