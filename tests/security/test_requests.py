"""Requests that cannot exhaust the server: capped bodies, bounded long polls, throttled logins and tokens."""
import os
import select
import socket
import threading

import httpx
import pytest
from django.test import Client
from django.urls import reverse

from plumbing import tokens
from tests.conftest import wait_until
from tests.factories import PASSWORD, DeploymentEventFactory, DeploymentFactory, UserFactory

GB = 1 << 30


def _send_chunked(base: str, path: str, total: int, headers: str = "") -> tuple[bytes, int]:
    """POST `total` bytes chunked (1 MiB chunks) until the server answers; (its answer, bytes sent)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n{headers}\r\n".encode())
    chunk, sent = b"x" * (1 << 20), 0
    try:
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered before the body ended
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        sock.settimeout(30)
        answer = sock.recv(4096)
    except (BrokenPipeError, ConnectionResetError):
        answer = sock.recv(4096) if select.select([sock], [], [], 5)[0] else b""
    finally:
        sock.close()
    return answer, sent


@pytest.mark.parametrize("headers, cap", [("", 64 << 10), ("Authorization: Token not-a-token\r\n", 64 << 10),
                                          ("Authorization: Token {valid}\r\n", 32 << 20)])
def test_a_1_gb_chunked_body_is_refused_early_and_leaves_no_file(live_server_asgi, tmp_path, monkeypatch, headers, cap):
    """What the server read is its own record (each body message the handler took), not what the client managed to
    send before it saw the answer, which depends on the machine's pace and the sockets' buffers."""
    import tempfile

    from plumbing import handler

    headers = headers.format(valid=tokens.issue(UserFactory(role="operator"))) if "{valid}" in headers else headers
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))  # where Django would spool a large body
    read, capped_body = [], handler.ThreadedASGIHandler.read_capped_body

    async def counted(self, scope, receive):
        async def counting():
            message = await receive()
            read.append(len(message.get("body", b"")))
            return message
        return await capped_body(self, scope, counting if scope["method"] == "POST" else receive)

    monkeypatch.setattr(handler.ThreadedASGIHandler, "read_capped_body", counted)
    answer, sent = _send_chunked(live_server_asgi, "/healthz", GB, headers)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sum(read) - max(read) <= cap < sum(read)  # it stopped at the message that passed the cap
    assert sent < GB  # and the client's gigabyte never went through
    assert list(spool.iterdir()) == []
    assert httpx.get(f"{live_server_asgi}/healthz", timeout=30).status_code == 200  # a loaded CI machine is slow


def test_fifty_long_polls_from_one_viewer_leave_the_server_answering(live_server_asgi, viewer, settings):
    """Past the user's limit a long poll answers at once with the state it was given; only the limit's polls wait,
    answered by the next change. Told apart by their answers, not by how long they took."""
    d = DeploymentFactory()
    headers = {"Authorization": f"Token {tokens.issue(viewer)}"}
    url = f"{live_server_asgi}/api/deployments/{d.pk}/events/"
    state = httpx.get(url, headers=headers, timeout=10).json()["state"]
    answers = []

    def poll():
        answers.append(httpx.get(url, params={"state": state, "wait": 30}, headers=headers, timeout=90).json())

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(50)]
    for t in threads:
        t.start()
    held = 50 - settings.LONG_POLLS_PER_USER
    wait_until(lambda: len(answers) >= held, timeout=25, message=f"{held} polls past the limit to answer")
    assert len(answers) == held and all(a["state"] == state for a in answers)
    # The limit's polls hold their threads, and the server still answers others meanwhile.
    assert httpx.get(f"{live_server_asgi}/healthz", timeout=30).status_code == 200
    assert httpx.get(f"{live_server_asgi}/api/nodes/", headers=headers, timeout=30).status_code == 200
    assert len(answers) == held
    event = DeploymentEventFactory(deployment=d)  # a new event answers the polls still waiting, as it would a browser's
    for t in threads:
        t.join(60)
    waited = answers[held:]
    assert len(waited) == settings.LONG_POLLS_PER_USER
    assert all(a["state"] != state and event.message in [e["message"] for e in a["events"]] for a in waited)


def test_the_pre_login_body_cap_holds_until_a_credential_is_valid(live_server_asgi, settings):
    """A forged Authorization header or session cookie keeps the 64 KiB cap (413 before any view); a valid
    token or session lifts it (the view answers: DRF's 400 for a body that is no deployment, CSRF's 403)."""
    settings.TOKEN_FAILURES_PER_MINUTE = 1000  # the wrong tokens below count against the address
    user = UserFactory(role="operator")
    good = tokens.issue(user)
    logged_in = Client()
    logged_in.force_login(user)
    session = logged_in.cookies[settings.SESSION_COOKIE_NAME].value
    body = b'{"name": "' + b"x" * (1 << 20) + b'"}'
    post = lambda **headers: httpx.post(f"{live_server_asgi}/api/deployments/", content=body, timeout=30,  # noqa: E731
                                        headers={"Content-Type": "application/json", **headers}).status_code
    refused = {"no credential": post(), "bogus token": post(Authorization="Token pct_bogus"),
               "bogus bearer": post(Authorization="Bearer anything"), "forged session": post(Cookie=f"{settings.SESSION_COOKIE_NAME}=forged")}
    assert refused == dict.fromkeys(refused, 413)
    user.is_active = False
    user.save()
    assert post(Authorization=f"Token {good}") == 413  # a disabled user's token is no credential
    user.is_active = True
    user.save()
    assert post(Authorization=f"Token {good}") == 400  # reached the view: the body is read and validated
    assert post(Cookie=f"{settings.SESSION_COOKIE_NAME}={session}") == 403  # reached Django: CSRF refuses the POST
    assert httpx.post(f"{live_server_asgi}/api/deployments/", content=b"{}", headers={"Authorization": "Token pct_bogus"},
                      timeout=30).status_code == 401  # a small body still reaches the API, which answers for itself


@pytest.mark.django_db
def test_logins_are_locked_after_repeated_failures_for_that_user(settings):
    UserFactory(username="alice", role="viewer")
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert client.post(reverse("login"), {"username": "alice", "password": "wrong"}).status_code == 200
    assert client.post(reverse("login"), {"username": "alice", "password": "wrong"}).status_code == 429
    locked = client.post(reverse("login"), {"username": "alice", "password": PASSWORD})
    assert locked.status_code == 429 and not client.session.get("_auth_user_id")
    other = Client().post(reverse("login"), {"username": UserFactory(role="viewer").username, "password": PASSWORD})
    assert other.status_code == 302  # someone else from the same address still logs in


@pytest.mark.django_db
def test_guessing_api_tokens_is_throttled(settings, viewer):
    settings.TOKEN_FAILURES_PER_MINUTE = 5
    client, good = Client(REMOTE_ADDR="10.9.8.7"), tokens.issue(viewer)
    answers = [client.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token pct_guess{i}").status_code for i in range(7)]
    assert answers[:5] == [401] * 5 and answers[5:] == [429, 429]
    assert Client(REMOTE_ADDR="10.9.8.6").get("/api/nodes/", HTTP_AUTHORIZATION=f"Token {good}").status_code == 200


@pytest.mark.django_db
def test_behind_a_listed_proxy_lockouts_and_token_throttles_count_each_client_and_a_forged_header_counts_nothing(settings,
                                                                                                                  viewer):
    """Behind a reverse proxy every request connects from the proxy: without TRUSTED_PROXIES five bad logins locked
    the user out for everyone. From a listed proxy, X-Forwarded-For's last address it did not add is the client;
    from anyone else the header is ignored (a forged one moves no count)."""
    settings.TRUSTED_PROXIES, settings.TOKEN_FAILURES_PER_MINUTE = ["10.0.0.0/24"], 5
    UserFactory(username="bob", role="viewer")

    def via_proxy(client_ip):  # a proxy appends the address it saw; an attacker may have sent its own first
        return Client(REMOTE_ADDR="10.0.0.5", HTTP_X_FORWARDED_FOR=f"6.6.6.6, {client_ip}")

    attacker = via_proxy("203.0.113.9")
    for _ in range(settings.AXES_FAILURE_LIMIT):
        attacker.post(reverse("login"), {"username": "bob", "password": "wrong"})
    assert attacker.post(reverse("login"), {"username": "bob", "password": PASSWORD}).status_code == 429
    assert via_proxy("198.51.100.7").post(reverse("login"), {"username": "bob", "password": PASSWORD}).status_code == 302
    guesses = [attacker.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token pct_guess{i}").status_code for i in range(6)]
    assert guesses[5] == 429
    good = tokens.issue(viewer)
    assert via_proxy("198.51.100.7").get("/api/nodes/", HTTP_AUTHORIZATION=f"Token {good}").status_code == 200
    # Not from a listed proxy: the header is the sender's own words, and the connecting address counts.
    forged = Client(REMOTE_ADDR="192.0.2.50", HTTP_X_FORWARDED_FOR="198.51.100.7")
    answers = [forged.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token pct_forged{i}").status_code for i in range(6)]
    assert answers == [401] * 5 + [429]  # 192.0.2.50's own count, not 198.51.100.7's
    assert via_proxy("198.51.100.7").get("/api/nodes/", HTTP_AUTHORIZATION="Token pct_other").status_code == 401


def test_a_trusted_proxy_that_is_no_address_stops_the_settings_from_loading(tmp_path):
    from tests.security.test_at_rest import _settings_load

    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "SECRET_KEY_FILE", "DEBUG")}
    base = {**env, "SECRET_KEY": "k" * 50, "PANEL_VAR_DIR": str(tmp_path)}
    refused = _settings_load({**base, "TRUSTED_PROXIES": "10.0.0.5, proxy.example.com"})
    assert refused.returncode != 0 and "TRUSTED_PROXIES: 'proxy.example.com' is not an address or a network" in refused.stderr
    assert _settings_load({**base, "TRUSTED_PROXIES": "10.0.0.5, 10.1.0.0/16, ::1"}).returncode == 0
