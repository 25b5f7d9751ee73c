"""Horizontal scale of the control plane: two web processes behind one Redis and one database. A
browser connected to one sees the updates caused through the other, and the fleet's samples
through either."""
import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings

from deployments.services import nodes
from plumbing import tokens
from tests import fleetsim
from tests.conftest import free_port, wait_until
from tests.factories import DeploymentFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.timeout(180)


def _web(spawn, env, port):
    proc = spawn([sys.executable, "-m", "uvicorn", "controlpanel.asgi:application", "--host", "127.0.0.1", "--port", str(port),
                  "--ws", "websockets-sansio", "--log-level", "warning"], env, name=f"web-{port}")
    return proc


def _up(port) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_browser_on_one_web_process_sees_what_is_done_through_the_other(process_env, spawn, client):
    import httpx

    operator = UserFactory(role="operator")
    node = NodeFactory(name="two-web")
    deployment = DeploymentFactory(node=node, status="ready")
    client.force_login(operator)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    token = tokens.issue(operator)
    ports = [free_port(), free_port()]
    procs = [_web(spawn, process_env, port) for port in ports]
    wait_until(lambda: all(_up(p) for p in ports), timeout=90, message="both web processes to answer")

    async def watch_a_then_act_on_b():
        from websockets.asyncio.client import connect

        a, b = ports
        async with connect(f"ws://127.0.0.1:{a}/ws/live/", additional_headers={"Cookie": cookie, "Origin": f"http://127.0.0.1:{a}"}) as ws:
            await ws.send(json.dumps({"subscribe": ["fleet", f"deployment:{deployment.pk}"]}))
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert (first["kind"], first.get("snapshot")) == ("nodes", True)
            # Through web process B's API: the stop shows on the deployment page served by A.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{b}", headers={"Authorization": f"Token {token}"}) as api:
                response = await api.post(f"/api/deployments/{deployment.pk}/stop/")
                assert response.status_code == 202, response.text
            status = await _next(ws, lambda m: m["topic"] == f"deployment:{deployment.pk}" and m["kind"] == "status"
                                 and not m.get("snapshot"))  # the subscribe's snapshot says "ready"
            assert status["data"]["status"] == "stopping"
            # A node's sample, recorded the agent's way: the fleet page served by A shows it.
            sample = fleetsim.synthetic_sample(1, 2, time.time())
            await asyncio.to_thread(nodes.node_sample_record, node.pk, sample, {})
            fleet = await _next(ws, lambda m: m["kind"] == "nodes" and str(node.pk) in m["data"]["nodes"])
            assert fleet["data"]["nodes"][str(node.pk)]["t"] == sample["t"]

    # A thread of its own: in the whole suite Playwright's event loop already runs on this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, watch_a_then_act_on_b()).result()
    assert all(p.poll() is None for p in procs)


async def _next(ws, wanted):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        message = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic())))
        if wanted(message):
            return message
    pytest.fail("the expected live message never came")
