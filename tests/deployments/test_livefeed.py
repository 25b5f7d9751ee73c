"""The fleet page's feed: one coalesced message per tick per socket with only the nodes that changed,
a slow socket skipping to the latest state, drops of the Channels layer counted, and the fleet
load model (tests/fleetsim.py) driving the real agent code."""
import asyncio
import json
import re
from dataclasses import asdict
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from channels_redis.core import RedisChannelLayer
from django.conf import settings

from controlpanel.metricsview import exposition
from deployments import payloads
from deployments.models import ModelCopy, Node
from deployments.services import nodes
from plumbing.live import drops, fleetfeed, snapshots
from tests import fleetsim
from tests.conftest import run_async
from tests.factories import NodeFactory, UserFactory


def _cookie(client, user) -> bytes:
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


async def _socket(client, user) -> WebsocketCommunicator:
    cookie = await sync_to_async(_cookie)(client, user)
    ws = WebsocketCommunicator(live_app(), "/ws/live/", headers=[(b"cookie", cookie), (b"origin", b"http://localhost"),
                                                                 (b"host", b"localhost")])
    connected, _ = await ws.connect(timeout=30)
    assert connected
    return ws


def live_app():
    from controlpanel.asgi import application

    return application


class _Ticks:
    """The feed's tick, ended by the test: the feed's `asyncio.sleep(LIVE_TICK_S)` waits for `end()`, so what goes
    out within a tick and what after it is set by the test, not by how fast this machine records samples. Each node
    change the feed hears is recorded in `heard` (the pub/sub hop is not instant)."""

    def __init__(self, monkeypatch, tick_s: float):
        self.tick_s, self.started, self.ends, self.heard = tick_s, asyncio.Queue(), asyncio.Queue(), []
        public = {k: v for k, v in vars(asyncio).items() if not k.startswith("__")}
        monkeypatch.setattr(fleetfeed, "asyncio", SimpleNamespace(**{**public, "sleep": self.sleep}))
        add = fleetfeed.FleetFeed._add

        def heard(feed, node_id, text):
            self.heard.append(node_id)
            add(feed, node_id, text)

        monkeypatch.setattr(fleetfeed.FleetFeed, "_add", heard)

    async def sleep(self, delay, result=None):
        if delay != self.tick_s:
            return await asyncio.sleep(delay, result)
        self.started.put_nowait(None)
        await self.ends.get()
        return result

    async def end(self):
        """End the tick the feed is in (waiting until it is in one)."""
        await asyncio.wait_for(self.started.get(), 5)
        self.ends.put_nowait(None)

    async def hear(self, *nodes):
        """Until the feed has heard each of `nodes` change."""
        for _ in range(500):
            if {str(n.pk) for n in nodes} <= set(self.heard):
                return
            await asyncio.sleep(0.01)
        pytest.fail(f"the feed never heard {[n.pk for n in nodes]}")


def _shown(sample) -> dict:
    return {"t": sample["t"], "disk": {"total": sample["disk"]["total"], "free": sample["disk"]["free"]},
            "gpus": [{"index": g["index"], "memory_used": g["memory_used"], "memory_total": g["memory_total"],
                      "util_gpu": g["util_gpu"]} for g in sample["gpus"]]}


@pytest.mark.django_db(transaction=True)
def test_a_fleet_page_gets_the_state_then_one_message_per_tick_with_the_nodes_that_changed(client, settings, monkeypatch):
    settings.LIVE_TICK_S = 3600.0  # a tick ends only when the test ends it (_Ticks)

    async def scenario():
        return await _coalesced(client, _Ticks(monkeypatch, settings.LIVE_TICK_S))

    run_async(scenario())


async def _coalesced(client, ticks):
    user = await sync_to_async(UserFactory)(role="viewer")
    fleet = [await sync_to_async(NodeFactory)(name=f"feed-{i}") for i in range(5)]
    before = fleetsim.synthetic_sample(0, 2, time.time() - 5)
    await sync_to_async(nodes.node_sample_record)(fleet[0].pk, before, {})
    ws = await _socket(client, user)
    await ws.send_json_to({"subscribe": ["fleet"]})
    snapshot = await ws.receive_json_from(timeout=5)
    assert snapshot["snapshot"] and snapshot["kind"] == "nodes"
    shown = json.loads(json.dumps(asdict(payloads.FleetNode.of(before))))
    assert snapshot["data"]["nodes"] == {str(fleet[0].pk): shown}

    async def record(node):
        sample = fleetsim.synthetic_sample(node.pk, 2, time.time())
        await sync_to_async(nodes.node_sample_record)(node.pk, sample, {})
        return sample

    async def message():
        got = await ws.receive_json_from(timeout=5)
        assert (got["topic"], got["kind"]) == ("fleet", "nodes") and "snapshot" not in got
        return got["data"]["nodes"]

    # The first change after a quiet spell goes out at once, and a tick starts.
    first = await record(fleet[1])
    assert await message() == {str(fleet[1].pk): _shown(first)}
    # Changes heard within the tick wait for its end, then go out together in one message.
    within = {node.pk: await record(node) for node in fleet[2:4]}
    await ticks.hear(*fleet[2:4])
    assert await ws.receive_nothing(timeout=0.3)  # heard, and the tick holds them: no message per change
    await ticks.end()
    assert await message() == {str(k): _shown(s) for k, s in within.items()}
    # The next tick carries only what changed in it: nothing already sent is sent again.
    last = await record(fleet[4])
    await ticks.hear(fleet[4])
    await ticks.end()
    assert await message() == {str(fleet[4].pk): _shown(last)}
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
def test_with_live_trace_a_fleet_message_says_when_each_stage_of_the_feed_handled_it(client, settings):
    """perf/fleet_scale.py splits sample-to-browser latency into stages with these times."""
    settings.LIVE_TRACE = True
    run_async(_traced(client))


async def _traced(client):
    user = await sync_to_async(UserFactory)(role="viewer")
    node = await sync_to_async(NodeFactory)(name="traced")
    ws = await _socket(client, user)
    await ws.send_json_to({"subscribe": ["fleet"]})
    await ws.receive_json_from(timeout=5)  # the snapshot
    sample = fleetsim.synthetic_sample(node.pk, 2, time.time())
    await sync_to_async(nodes.node_sample_record)(node.pk, sample, {})
    message = await ws.receive_json_from(timeout=5)
    received = time.time()
    state = message["data"]["nodes"][str(node.pk)]
    assert sample["t"] <= state["pub"] <= state["heard"] <= message["flushed"] <= received
    assert state["gpus"] == [{"index": g["index"], "memory_used": g["memory_used"], "memory_total": g["memory_total"],
                              "util_gpu": g["util_gpu"]} for g in sample["gpus"]]
    await ws.disconnect()


def test_without_live_trace_a_fleet_state_carries_no_stage_times():
    assert fleetfeed.stamp('{"t":1}', "pub") == '{"t":1}'


def test_a_slow_browser_skips_to_the_latest_state_of_each_node():
    async def scenario():
        gate, sent = asyncio.Event(), []

        async def send(text):
            sent.append(json.loads(text))
            await gate.wait()

        def offer(nodes):
            subscriber.offer(nodes, fleetfeed.fleet_message(nodes))

        subscriber = fleetfeed.Subscriber(send)
        superseded = fleetfeed.counts["superseded"]
        offer({"1": '{"t":1}'})
        await asyncio.sleep(0)  # the first goes out and its send hangs: the browser reads slowly
        offer({"1": '{"t":2}'})
        offer({"1": '{"t":3}', "2": '{"t":3}'})
        gate.set()
        while len(sent) < 2:
            await asyncio.sleep(0.01)
        subscriber.close()
        return sent, fleetfeed.counts["superseded"] - superseded

    sent, superseded = run_async(scenario())  # on its own loop: Playwright may own this thread's
    assert [m["data"]["nodes"] for m in sent] == [{"1": {"t": 1}}, {"1": {"t": 3}, "2": {"t": 3}}]
    assert superseded == 1  # node 1 at t=2 was never shown: the browser went straight to t=3


@pytest.mark.django_db
def test_messages_the_channel_layer_drops_are_counted_and_exported():
    layer = RedisChannelLayer(hosts=[settings.REDIS_URL], capacity=1, prefix=f"drops{uuid.uuid4().hex[:8]}")
    drops.count_drops()
    before = drops.dropped()

    async def send_three():
        channel = await layer.new_channel()
        await layer.group_add("slow", channel)
        for i in range(3):  # nobody reads: the first fills the socket's queue, the next two are dropped
            await layer.group_send("slow", {"type": "live.message", "n": i})
        await layer.flush()

    run_async(send_three())
    assert drops.dropped() - before == 2
    exported = re.search(r"^panel_live_dropped_messages_total (\S+)$", exposition().decode(), re.M)
    assert exported and float(exported[1]) == drops.dropped()


@pytest.mark.django_db(transaction=True)
def test_the_fleet_model_drives_the_real_agent_code_for_many_nodes_in_one_process():
    fleet = fleetsim.Fleet([f"sim-{i}" for i in range(3)], gpus=2, engines=1, downloads=1)
    try:
        stop = threading.Event()
        runner = threading.Thread(target=fleet.run, args=(4.5, stop))  # the crash watch reads engines every 2 s
        runner.start()
        runner.join(30)
    finally:
        fleet.close()
    published = fleet.published()
    assert sorted(Node.objects.filter(name__startswith="sim-").values_list("pk", flat=True)) == sorted(published)
    assert all(len(ts) >= 2 for ts in published.values())  # every node ticked more than once
    state = fleetfeed.fleet_state()
    assert {int(k): json.loads(v)["t"] for k, v in state.items()} == {k: ts[-1] for k, ts in published.items()}
    assert all(n.last_heartbeat is not None and n.disk_total for n in Node.objects.filter(pk__in=published))
    engine = fleet.agents[0]
    figures = {m["kind"]: m["data"] for m in snapshots.snapshot(payloads.deployment_topic(engine.deployment_id))}
    assert figures["engine"]["running"] == 4.0 and figures["engine"]["tok_s"] > 0  # its engine's figures reached its page
    copy = ModelCopy.objects.get(pk=fleet.agents[1].copy.pk)
    assert copy.state == ModelCopy.State.DOWNLOADING and copy.bytes_done > 0  # the download reported progress


def test_browsers_are_spread_over_the_pages_in_a_fleets_proportions():
    plan = fleetsim.pages(list(range(1, 129)), [1, 2, 3], 50)
    kinds = [topics[0].split(":")[0] for topics in plan]
    assert (kinds.count("fleet"), kinds.count("node"), kinds.count("deployment")) == (30, 15, 5)


def test_the_account_counts_a_sample_a_watching_browser_never_got_as_lost():
    published = {1: [10.0, 11.0, 12.0, 13.0, 14.0], 2: [10.5, 11.5, 12.5, 13.5, 14.5]}
    fleet = {"topics": ["fleet"], "opened": 7.9, "ready": 8.0, "samples": [
        [1, 10.0, 10.01], [2, 10.5, 10.52], [1, 11.0, 11.02], [1, 12.0, 12.01], [2, 12.5, 12.51], [1, 17.0, 17.0]]}
    node = {"topics": ["node:2"], "opened": 7.9, "ready": 8.0, "samples": [[2, 10.5, 10.5], [2, 11.5, 11.5], [2, 17.0, 17.0]]}
    result = fleetsim.account(published, [fleet, node], end=17.0, margin=2.0)
    # ready + 2 <= t <= end - 2: fleet expects 1@10,11,12,13,14 and 2@10.5..14.5 and missed 2@11.5,
    # 1@13, 2@13.5, 1@14, 2@14.5; the node page expects 2@10.5..14.5 and missed three.
    assert (result["expected"], result["lost"]) == (15, 8)
    assert len(result["latencies"]) == 9


def test_a_browser_whose_socket_died_mid_run_or_that_heard_nothing_lost_the_rest_of_the_run():
    published = {1: [10.0 + k for k in range(20)]}  # node 1 published at 10..29 s
    died = {"topics": ["node:1"], "opened": 7.9, "ready": 8.0, "closed": 13.2,
            "samples": [[1, 10.0, 10.01], [1, 11.0, 11.01], [1, 12.0, 12.01], [1, 13.0, 13.01]]}
    silent = {"topics": ["fleet"], "opened": 7.9, "ready": None, "closed": None, "samples": []}
    result = fleetsim.account(published, [died], end=32.0)
    # Its window is 10..30 s, the run's, not 10..11 s, up to its own last arrival less the margin.
    assert (result["expected"], result["lost"], result["closed"]) == (20, 16, 1)
    result = fleetsim.account(published, [silent], end=32.0)
    assert (result["expected"], result["lost"]) == (20, 20)  # 9.9..30 s: it never got any of them


def test_browse_records_a_socket_the_server_closed_and_the_account_counts_what_came_after_as_lost():
    from websockets.asyncio.server import serve

    sent = []

    async def page(ws):  # two samples of node 1, then the server goes away
        await ws.recv()  # the subscription
        await ws.send(json.dumps({"snapshot": True, "topic": "node:1"}))
        for _ in range(2):
            sent.append(time.time())
            await ws.send(json.dumps({"topic": "node:1", "kind": "sample", "data": {"t": sent[-1]}}))
        await ws.close()

    async def scenario():
        async with serve(page, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            return await fleetsim.browse(f"ws://127.0.0.1:{port}/", "", "http://127.0.0.1", [["node:1"]], seconds=30)

    started = time.monotonic()
    [seen] = run_async(scenario())
    # It stopped at the close, not at its 30 s: the bound is the 30 s itself, whatever else the host is doing.
    assert seen["closed"] is not None and time.monotonic() - started < 30
    assert [t for _, t, _ in seen["samples"]] == sent
    later = [seen["closed"] + 3 + k for k in range(5)]  # what the node published after the socket died
    result = fleetsim.account({1: sent + later}, [seen], end=seen["closed"] + 10)
    assert (result["lost"], result["closed"]) == (5, 1)
