"""The moving parts under everything: Celery through real Redis to a node's own queue, and
Channels through the real Redis layer to a WebSocket client."""
import sys
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings

from controlpanel.asgi import application
from deployments import payloads, tasks
from deployments.models import Node
from plumbing import redisconn
from plumbing.live import fleetfeed, publishing
from tests.conftest import agent_argv, run_async, wait_until


@pytest.mark.timeout(120)
def test_a_task_sent_to_a_node_queue_runs_on_that_nodes_agent_only(process_env, spawn, unique, tmp_path):
    names = [f"alpha-{unique}", f"beta-{unique}"]
    agents = {name: spawn(agent_argv(name, tmp_path / name), process_env, name=name) for name in names}
    wait_until(lambda: Node.objects.filter(name__in=names).count() == 2, timeout=60, message="both agents to register")

    for name in names:
        result = tasks.node_ping.apply_async(queue=f"node.{name}").get(timeout=60)
        assert result["node"] == name, open(agents[name].log_path).read()[-2000:]


def test_the_celery_app_talks_to_the_configured_redis():
    from controlpanel.celery import app

    assert app.conf.broker_url == settings.REDIS_URL
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1)


def _session_cookie(client, user) -> bytes:
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


@pytest.mark.django_db(transaction=True)
def test_a_published_message_reaches_a_subscribed_browser_through_redis(client, unique):
    run_async(_published_message_reaches_client(client, unique))


async def _published_message_reaches_client(client, unique):
    from tests.factories import NodeFactory, UserFactory

    user = await sync_to_async(UserFactory)(role="viewer")
    node = await sync_to_async(NodeFactory)(name=f"ws-{unique}")
    cookie = await sync_to_async(_session_cookie)(client, user)
    ws = WebsocketCommunicator(application, "/ws/live/", headers=[(b"cookie", cookie), (b"origin", b"http://localhost"), (b"host", b"localhost")])
    connected, _ = await ws.connect(timeout=30)
    assert connected
    await ws.send_json_to({"subscribe": [payloads.node_topic(node.pk)]})
    # The subscription is in place once a second publish round-trips; publish until one arrives.
    for _ in range(50):
        await sync_to_async(publishing.publish)(payloads.node_topic(node.pk), "sample",
                                                {"gpus": [{"index": 0, "memory_used": 42}]})
        try:
            message = await ws.receive_json_from(timeout=0.2)
            break
        except Exception:  # noqa: BLE001 - asyncio.TimeoutError from the communicator
            continue
    else:
        pytest.fail("no live message reached the WebSocket client")
    assert message["topic"] == f"node:{node.pk}"
    assert message["data"]["gpus"][0]["memory_used"] == 42
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
def test_a_reconnecting_browser_first_gets_the_last_snapshot(client, unique):
    run_async(_reconnect_gets_snapshot(client, unique))


async def _reconnect_gets_snapshot(client, unique):
    from tests.factories import NodeFactory, UserFactory

    user = await sync_to_async(UserFactory)(role="viewer")
    node = await sync_to_async(NodeFactory)(name=f"snap-{unique}")
    await sync_to_async(publishing.publish)(payloads.node_topic(node.pk), "sample", {"seq": 7})
    cookie = await sync_to_async(_session_cookie)(client, user)
    ws = WebsocketCommunicator(application, "/ws/live/", headers=[(b"cookie", cookie), (b"origin", b"http://localhost"), (b"host", b"localhost")])
    assert (await ws.connect(timeout=30))[0]
    await ws.send_json_to({"subscribe": [payloads.node_topic(node.pk), "bogus:topic"]})
    first = await ws.receive_json_from(timeout=5)
    second = await ws.receive_json_from(timeout=5)
    by_kind = {("error" if "error" in m else m["kind"]): m for m in (first, second)}
    assert by_kind["sample"]["snapshot"] is True and by_kind["sample"]["data"] == {"seq": 7}
    assert "unknown topic" in by_kind["error"]["error"]
    await ws.disconnect()



def test_the_tests_keep_their_redis_keys_apart_from_a_running_panel():
    # A panel on the same Redis uses the default prefix "panel"; what a test publishes must land elsewhere.
    topic = payloads.node_topic(int(uuid.uuid4().int % 10**12))
    publishing.publish(topic, "sample", {"seq": 1})
    written = [k.decode() for k in redisconn.client().scan_iter(f"*:snapshot:{topic}")]
    assert written and not any(key.startswith("panel:") for key in written), written


def test_a_live_socket_waiting_longer_than_redis_answers_is_not_dropped():
    """channels-redis blocks 5 s per BZPOPMIN; redis-py's asyncio default socket timeout is also 5 s, so an idle
    socket's receive died with redis TimeoutError now and then (the web log's drops). It must just keep waiting."""
    import asyncio

    from channels.layers import get_channel_layer

    async def idle_receive():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        try:
            await asyncio.wait_for(layer.receive(channel), timeout=layer.brpop_timeout * 2 + 1)
        except asyncio.TimeoutError:
            return "still waiting"  # ours: nothing came, and Redis never failed the wait

    assert run_async(idle_receive()) == "still waiting"


def test_panels_on_two_databases_of_one_redis_do_not_hear_each_others_fleet_changes(settings, monkeypatch):
    """Pub/sub channels are global to a Redis server: the fleet channel's name carries the database."""
    kwargs = redisconn.client().connection_pool.connection_kwargs
    channels = {}
    for db in (4, 5):
        monkeypatch.setattr(redisconn, "_client", None)
        settings.REDIS_URL = f"redis://{kwargs['host']}:{kwargs['port']}/{db}"
        channels[db] = (redisconn.client(), fleetfeed.fleet_channel())
    monkeypatch.setattr(redisconn, "_client", None)
    (client_a, channel_a), (client_b, channel_b) = channels[4], channels[5]
    listener = client_a.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(channel_a)
    listener.get_message(timeout=2)  # the subscription's confirmation
    assert client_b.publish(channel_b, "7 {}") == 0  # nobody on the other database's channel
    assert client_a.publish(channel_a, "8 {}") == 1
    message = listener.get_message(timeout=2)
    assert message and message["data"] == b"8 {}"
    listener.close()
