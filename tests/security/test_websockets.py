"""An open WebSocket follows its session and role: logout or a lost role closes it; subscriptions are
bounded and only to objects that exist."""
import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Group
from django.contrib.sessions.models import Session
from django.test import Client

from controlpanel.asgi import application
from plumbing.live import consumer
from tests.conftest import run_async
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _login(user) -> tuple[Client, bytes]:
    client = Client()
    client.force_login(user)
    return client, f"sessionid={client.cookies['sessionid'].value}".encode()


async def _open(cookie: bytes) -> WebsocketCommunicator:
    ws = WebsocketCommunicator(application, "/ws/live/",
                               headers=[(b"cookie", cookie), (b"origin", b"http://localhost"), (b"host", b"localhost")])
    connected, code = await ws.connect(timeout=30)
    assert connected, code
    return ws


async def _closed_with(ws) -> int:
    message = await ws.receive_output(timeout=5)
    assert message["type"] == "websocket.close", message
    return message["code"]


def test_logging_out_closes_that_sessions_sockets_only():
    async def scenario():
        user = await sync_to_async(UserFactory)(role="viewer")
        client, cookie = await sync_to_async(_login)(user)
        _, other_cookie = await sync_to_async(_login)(user)
        ws, other = await _open(cookie), await _open(other_cookie)
        await sync_to_async(client.post)("/accounts/logout/")
        assert await _closed_with(ws) == 4401
        assert await other.receive_nothing(timeout=0.5)  # the other browser stays logged in
        await other.disconnect()
    run_async(scenario())


def test_losing_the_role_closes_the_socket_and_keeping_one_does_not():
    async def scenario():
        user = await sync_to_async(UserFactory)(role="operator")
        await sync_to_async(lambda: user.groups.add(Group.objects.get_or_create(name="viewer")[0]))()
        _, cookie = await sync_to_async(_login)(user)
        ws = await _open(cookie)
        await sync_to_async(lambda: user.groups.remove(user.groups.get(name="operator")))()
        assert await ws.receive_nothing(timeout=0.5)  # still a viewer
        await sync_to_async(user.groups.clear)()
        assert await _closed_with(ws) == 4403
        await ws.disconnect()
    run_async(scenario())


def test_a_session_ended_behind_the_sockets_back_is_noticed_on_the_timer(settings):
    settings.WS_RECHECK_SECONDS = 0.2

    async def scenario():
        user = await sync_to_async(UserFactory)(role="viewer")
        _, cookie = await sync_to_async(_login)(user)
        ws = await _open(cookie)
        await sync_to_async(lambda: Session.objects.all().delete())()  # expiry, or a flush by an admin
        assert await _closed_with(ws) == 4401
        await ws.disconnect()
    run_async(scenario())


def test_a_user_without_a_role_cannot_open_a_socket():
    async def scenario():
        user = await sync_to_async(UserFactory)()
        _, cookie = await sync_to_async(_login)(user)
        ws = WebsocketCommunicator(application, "/ws/live/",
                                   headers=[(b"cookie", cookie), (b"origin", b"http://localhost"), (b"host", b"localhost")])
        connected, code = await ws.connect(timeout=30)
        assert not connected and code == 4403
        await ws.disconnect()
    run_async(scenario())


def test_subscriptions_are_to_existing_objects_and_capped_per_socket(monkeypatch):
    monkeypatch.setattr(consumer, "MAX_TOPICS", 3)

    async def scenario():
        user = await sync_to_async(UserFactory)(role="viewer")
        nodes = [await sync_to_async(NodeFactory)() for _ in range(4)]
        _, cookie = await sync_to_async(_login)(user)
        ws = await _open(cookie)
        await ws.send_json_to({"subscribe": ["node:987654321", "deployment:1", "run:5"]})
        errors = [await ws.receive_json_from(timeout=5) for _ in range(3)]
        assert all("unknown topic" in e["error"] for e in errors)
        await ws.send_json_to({"subscribe": [f"node:{n.pk}" for n in nodes]})
        capped = await ws.receive_json_from(timeout=5)
        assert capped == {"error": "at most 3 topics per connection"}
        await ws.send_json_to({"subscribe": "not a list", "unsubscribe": {"x": 1}})
        assert await ws.receive_nothing(timeout=0.3)
        await ws.disconnect()
    run_async(scenario())
