"""WebSocket routes. Every consumer refuses anonymous users (see deployments.consumers)."""
from django.urls import path

from deployments import consumers

websocket_urlpatterns = [
    path("ws/live/", consumers.LiveConsumer.as_asgi()),
]
