"""Redis restarted empty (or flushed, or away and back with its data): an open deployment page says it
cannot get live data and then shows live figures again without a reload; a client's retried create
with the same Idempotency-Key creates nothing new; a token revoked while Redis was away is refused
by another web process once Redis is back."""
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis
from django.urls import reverse
from playwright.sync_api import expect

from deployments import payloads
from deployments.models import Deployment
from plumbing import tokens
from tests.conftest import free_port, wait_until
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory
from tests.faults.conftest import COUNTS, OUTAGE_S

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
HEARTBEAT_S = 0.5  # the page gives up a socket after 3 missed beats + 1 s: 2.5 s here


class _Figures(threading.Thread):
    """Engine figures for one deployment, sent the agent's way (payloads.send_engine_figures) every 0.2 s;
    tok_s counts the messages, so the page's figure tells which one it last got."""

    def __init__(self, d):
        super().__init__(daemon=True)
        self.d, self.sent, self.done = d, 0, threading.Event()

    def run(self):
        while not self.done.wait(0.2):
            self.sent += 1
            payloads.send_engine_figures(self.d.node_id, payloads.EngineFigures(
                id=self.d.pk, name=self.d.name, tok_s=float(self.sent), running=1, waiting=0, kv_cache=0.25))


def _shown_tok_s(page) -> float:
    text = page.locator("#engine-now").text_content() or ""
    return float(text.split(" tok/s")[0]) if " tok/s" in text else -1.0


def _figures_move_again(page, figures, banner, timeout):
    """The banner goes, and the page shows figures sent after that: live again, through the layer."""
    expect(banner).to_be_hidden(timeout=timeout * 1000)
    after = figures.sent
    wait_until(lambda: _shown_tok_s(page) > after + 2, timeout=timeout, message="live figures after the outage")


@pytest.mark.timeout(120 + 4 * OUTAGE_S)
def test_a_deployment_page_shows_the_outage_then_live_figures_again_without_a_reload(private_redis, settings,
                                                                                     logged_in_page, unique):
    settings.LIVE_HEARTBEAT_S = HEARTBEAT_S
    page = logged_in_page
    node = NodeFactory(name=f"redis-{unique}")
    d = DeploymentFactory(node=node, status="ready", pid=4242, pgid=4242)
    figures = _Figures(d)
    figures.start()
    try:
        page.goto(f"{page.base_url}/deployments/{d.pk}/")
        page.evaluate("window.sameDocument = true")
        expect(page.locator("#live-state")).to_have_text("live")
        wait_until(lambda: _shown_tok_s(page) > 0, timeout=15, message="live figures on the page")
        banner = page.locator("#live-banner")

        # 1. FLUSHALL: the connection stays, but every Channels group is gone; nothing but the missing
        #    heartbeats tells.
        flushed = time.monotonic()
        redis.Redis(port=private_redis.port).flushall()
        COUNTS["redis_flushes"] += 1
        expect(banner).to_be_visible(timeout=10_000)
        _figures_move_again(page, figures, banner, timeout=20)
        print(f"FLUSHALL: live figures again after {time.monotonic() - flushed:.1f} s (heartbeat {HEARTBEAT_S} s)")

        # 2. Redis stopped (its data gone, as compose's and the embedded one keep nothing) and started.
        private_redis.stop()
        expect(banner).to_be_visible(timeout=10_000)
        expect(banner).to_have_text("Live updates paused: reconnecting…")
        # Meanwhile the deployment's row changes; its live update is lost with Redis.
        Deployment.objects.filter(pk=d.pk).update(status_message="changed while Redis was away")
        time.sleep(OUTAGE_S)
        expect(banner).to_be_visible()
        private_redis.start()
        started = time.monotonic()
        COUNTS["redis_outages"] += 1
        _figures_move_again(page, figures, banner, timeout=30)  # the page's backoff is at most 5 s
        print(f"restart: live figures again {time.monotonic() - started:.1f} s after Redis was back")
        assert page.evaluate("window.sameDocument") is True  # no reload
        # Redis kept no snapshot: the page redrew the status from the database's.
        expect(page.locator("#status-message")).to_have_text("changed while Redis was away")
    finally:
        figures.done.set()
        figures.join(10)


@pytest.mark.timeout(120)
def test_a_retried_create_after_redis_restarted_empty_creates_nothing_new(private_redis, live_server_asgi, operator):
    node = NodeFactory(name="idem-01", engine_flags=["--port", "--host"])
    for i in range(2):
        GpuFactory(node=node, index=i)
    copy = ModelCopyFactory(node=node, path="/models/idem", state="ready")
    body = {"model": copy.model.pk, "node": node.name, "gpus": [0, 1], "port": 9400}
    headers = {"Authorization": f"Token {tokens.issue(operator)}", "Idempotency-Key": "create-idem-01"}
    with httpx.Client(base_url=live_server_asgi, headers=headers, timeout=30) as api:
        first = api.post("/api/deployments/", json=body)
        assert first.status_code == 202, first.text
        private_redis.stop()
        private_redis.start()  # empty
        COUNTS["redis_outages"] += 1
        again = api.post("/api/deployments/", json=body)
    assert again.status_code == 202 and again.headers.get("Idempotent-Replayed") == "true", again.text
    assert again.json() == first.json()
    assert Deployment.objects.filter(node=node).count() == 1


class _KeptRedis:
    """A redis-server on the private server's port that keeps its data across a restart (append-only
    file): Redis away for a while and back with everything it had, as after a network cut."""

    def __init__(self, private, folder):
        self.argv = [private.binary, "--port", str(private.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "yes", "--appendfsync", "always", "--dir", str(folder)]
        self.port, self.proc = private.port, None

    def start(self):
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: _pings(self.port), timeout=10, message="redis-server")

    def stop(self):
        self.proc.terminate()  # SIGTERM: the append-only file is written out first
        self.proc.wait(10)


def _pings(port) -> bool:
    try:
        return redis.Redis(port=port, socket_timeout=1).ping()
    except redis.RedisError:
        return False


def _web(spawn, env, port):
    spawn([sys.executable, "-m", "uvicorn", "controlpanel.asgi:application", "--host", "127.0.0.1", "--port", str(port),
           "--ws", "websockets-sansio", "--log-level", "warning"], env, name=f"web-{port}")

    def up():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=90, message="the web process to answer")


@pytest.mark.timeout(150)
def test_a_token_revoked_while_redis_was_away_is_refused_by_another_web_process(private_redis, process_env, spawn,
                                                                              client, operator, tmp_path):
    private_redis.stop()
    kept = _KeptRedis(private_redis, tmp_path)
    kept.start()
    try:
        port = free_port()
        _web(spawn, process_env, port)  # the other web process; this test process revokes, as a web process would
        token = tokens.issue(operator)
        client.force_login(operator)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Token {token}"}, timeout=30) as other:
            for _ in range(2):  # the second answer's token check comes from the other process's cache
                assert other.get("/api/deployments/").status_code == 200
            kept.stop()
            assert client.post(reverse("account-token"), {"action": "revoke"}).status_code == 302
            assert not tokens.Token.objects.filter(user=operator).exists()
            kept.start()  # with every key it had: the cache versions the revocation could not bump
            COUNTS["redis_outages"] += 1
            back = time.monotonic()
            wait_until(lambda: other.get("/api/deployments/").status_code == 401, timeout=10,
                       message="the revoked token refused by the other web process")
            print(f"revoked token refused {time.monotonic() - back:.2f} s after Redis came back")
    finally:
        if kept.proc and kept.proc.poll() is None:
            kept.stop()
