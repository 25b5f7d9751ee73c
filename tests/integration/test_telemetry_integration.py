"""Two real node agents on the real Redis: each sample reaches a WebSocket client on its node's
topic, a killed agent goes offline within three heartbeats and comes back when restarted."""
import json
import os
import signal
import time

import pytest
from django.conf import settings
from websockets.sync.client import connect

from deployments.models import Node
from tests.conftest import agent_argv, wait_until

HEARTBEAT = 0.5


def _ws(live_server_asgi, client, user):
    client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    url = live_server_asgi.replace("http://", "ws://") + "/ws/live/"
    return connect(url, additional_headers={"Cookie": cookie, "Origin": live_server_asgi})


def _samples_from(ws, topics, timeout=20.0):
    """Read live messages until a sample from every topic arrived; return {topic: last sample}."""
    seen = {}
    deadline = time.monotonic() + timeout
    while set(seen) != set(topics):
        if time.monotonic() > deadline:
            pytest.fail(f"no live sample from {set(topics) - set(seen)} within {timeout} s")
        message = json.loads(ws.recv(timeout=timeout))
        if message.get("kind") == "sample" and not message.get("snapshot"):
            seen[message["topic"]] = message["data"]
    return seen


@pytest.mark.timeout(180)
def test_two_agents_stream_live_and_a_stopped_one_goes_offline_then_returns(
        process_env, spawn, unique, tmp_path, live_server_asgi, client, viewer):
    names = [f"a-{unique}", f"b-{unique}"]
    argv = {n: agent_argv(n, tmp_path / n, sample_seconds=0.25, heartbeat_seconds=HEARTBEAT) for n in names}
    agents = {n: spawn(argv[n], process_env, name=n) for n in names}
    nodes = wait_until(lambda: list(Node.objects.filter(name__in=names).order_by("name")) if
                       Node.objects.filter(name__in=names).count() == 2 else None, timeout=60, message="both agents")
    topics = [f"node:{n.pk}" for n in nodes]

    with _ws(live_server_asgi, client, viewer) as ws:
        ws.send(json.dumps({"subscribe": topics}))
        samples = _samples_from(ws, topics)
        for sample in samples.values():
            assert sample["disk"]["total"] > 0 and sample["host"]["ram_total"] > 0
            assert "nvml_error" in sample
        later = _samples_from(ws, topics)  # live: each node's next sample is a newer one, not a replay
        assert all(later[topic]["t"] > samples[topic]["t"] for topic in topics)

        os.killpg(agents[names[0]].pid, signal.SIGKILL)
        agents[names[0]].wait(10)
        killed_at = time.time()
        # Offline once the last heartbeat is three intervals old; the 10 s wait only guards a hang.
        wait_until(lambda: not Node.objects.get(pk=nodes[0].pk).online, timeout=10, message="node A offline")
        assert Node.objects.get(pk=nodes[0].pk).last_heartbeat.timestamp() <= killed_at  # no beat after the kill
        assert Node.objects.get(pk=nodes[1].pk).online
        _samples_from(ws, [topics[1]])  # B keeps streaming

        spawn(argv[names[0]], process_env, name=names[0] + "-again")
        wait_until(lambda: Node.objects.get(pk=nodes[0].pk).online, timeout=60, message="node A back online")
        _samples_from(ws, topics)
    assert Node.objects.filter(name__in=names).count() == 2  # the restart re-registered, not duplicated
