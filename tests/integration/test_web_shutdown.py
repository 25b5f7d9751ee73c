"""Ctrl-C on the web server while a client holds a long poll (`panelctl deploy --wait` follows a load through the
deployment's events, up to 30 s a poll): the poll is answered and the server stops without an error. uvicorn gives
open requests 3 s (`./panel start`), then cancelled the poll's task and printed "ERROR: Cancel 1 running task(s),
timeout graceful shutdown exceeded"."""
import asyncio
import base64
import json
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from channels.layers import get_channel_layer
from django.conf import settings

from panelctl import launcher
from plumbing import tokens
from plumbing.live import topics
from tests.conftest import free_port, wait_until
from tests.factories import DeploymentFactory, NodeFactory, UserFactory
from tests.integration.test_two_web import _up

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_ctrl_c_answers_a_held_long_poll_and_stops_the_web_server_without_an_error(process_env, spawn):
    deployment = DeploymentFactory(node=NodeFactory(name="shutdown-node"), status="loading")
    token = tokens.issue(UserFactory(role="operator"))
    port = free_port()
    web = spawn(launcher.web_argv("127.0.0.1", port), process_env, name="web")
    path = f"/api/deployments/{deployment.pk}/events/"
    wait_until(lambda: _up(port), timeout=90, message="the web server")
    state = httpx.get(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Token {token}"}).json()["state"]
    # The poll on a socket of the test's own: once sendall returns its bytes are in the server's receive queue, and
    # once that queue is empty the server has read the request and its task runs (nothing races the signal).
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"GET {path}?state={state}&wait=30 HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token {token}\r\n"
                 "Connection: close\r\n\r\n".encode())
    wait_until(lambda: _unread(port, sock.getsockname()[1]) == 0, timeout=30, message="the server to read the poll")
    web.send_signal(signal.SIGINT)  # nothing changes on this deployment: the poll would wait its whole 30 s
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    assert web.wait(30) == 0
    log = open(web.log_path).read()
    assert "ERROR" not in log and "Traceback" not in log, log
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:2000]
    assert json.loads(body)["state"] == state


def test_ctrl_c_stops_the_web_server_without_an_error_while_a_browser_has_stopped_reading_its_socket(
        process_env, spawn, client):
    """A browser that no longer reads (frozen, its machine asleep, its driver killed) while the panel keeps sending:
    the server's send buffer fills and the socket's close can never be flushed. The stop drops such a socket rather
    than wait its whole grace time and then cancel it with an error."""
    user = UserFactory(role="viewer")
    client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    port = free_port()
    web = spawn(launcher.web_argv("127.0.0.1", port), process_env, name="web")
    wait_until(lambda: _up(port), timeout=90, message="the web server")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's buffer fills sooner
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET /ws/live/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\nOrigin: http://127.0.0.1:{port}\r\n"
                 f"Cookie: {cookie}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    # From here the test reads nothing: what the panel sends piles up in the kernel's buffers, then in uvicorn's.
    layer = get_channel_layer()
    filler = {"type": "live.message", "message": {"topic": "filler", "kind": "filler", "data": "x" * 200_000}}

    async def fill():
        for _ in range(40):
            await layer.group_send(topics.user_group(user.pk), filler)

    # A thread of its own: in the whole suite Playwright's event loop already runs on this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, fill()).result()
    wait_until(lambda: (_unsent(port, sock.getsockname()[1]) or 0) > 1_000_000, timeout=30,
               message="the server's send queue to fill")
    web.send_signal(signal.SIGINT)
    assert web.wait(30) == 0
    sock.close()
    log = open(web.log_path).read()
    assert "ERROR" not in log and "Traceback" not in log, log


def _unread(port: int, client_port: int) -> int | None:
    """The server side's receive queue (bytes not yet read) of the connection from `client_port`, from /proc/net/tcp."""
    return _queue(port, client_port, 1)


def _unsent(port: int, client_port: int) -> int | None:
    """The server side's send queue (bytes the peer has not acknowledged) of the connection from `client_port`."""
    return _queue(port, client_port, 0)


def _queue(port: int, client_port: int, which: int) -> int | None:
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and int(fields[2].split(":")[1], 16) == client_port:
            return int(fields[4].split(":")[which], 16)  # tx_queue:rx_queue
    return None
