"""What must survive Redis losing everything, checked one part at a time (tests/faults/test_redis_restart.py
runs them with real processes): idempotency keys are rows, a socket's heartbeat goes through its own group,
and a deployment's snapshot falls back to the database."""
from datetime import timedelta
from unittest import mock

import pytest
import redis
import redis.backoff
import redis.retry
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlpanel.asgi import application
from deployments import payloads
from deployments.models import ModelRepo
from plumbing import redisconn, tokens
from plumbing.models import IdempotencyKey
from plumbing.live import snapshots, topics
from tests.conftest import free_port, run_async
from tests.factories import DeploymentFactory, UserFactory


@pytest.fixture
def api(operator):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(operator)}")
    return client


def _add(api, key, repo="org/kept"):
    with mock.patch("deployments.host.hub.repo_check", autospec=True, return_value="0" * 40):
        return api.post("/api/models/", {"repo_id": repo}, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.django_db
def test_an_idempotency_key_is_kept_where_redis_cannot_lose_it(api, unique, monkeypatch):
    first = _add(api, f"k-{unique}")
    # The retry meets a Redis that lost everything and is not even there (the tests' Redis is shared).
    unreachable = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5,
                              retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    monkeypatch.setattr(redisconn, "client", lambda: unreachable)
    again = _add(api, f"k-{unique}")
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    assert ModelRepo.objects.filter(repo_id="org/kept").count() == 1


@pytest.mark.django_db
def test_a_key_still_running_answers_409_and_one_past_a_day_runs_again(api, unique):
    first = _add(api, f"k-{unique}")
    IdempotencyKey.objects.update(status=None)  # as while the first call runs
    busy = _add(api, f"k-{unique}")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "in_progress"
    IdempotencyKey.objects.update(created=timezone.now() - timedelta(hours=25))
    again = _add(api, f"k-{unique}", repo="org/kept-2")
    assert first.status_code == again.status_code == 202 and "Idempotent-Replayed" not in again
    assert again.json()["repo_id"] == "org/kept-2"


@pytest.mark.django_db
def test_a_key_left_without_an_answer_by_a_dead_call_is_taken_over_after_the_pending_bound(api, unique):
    from plumbing import idempotency

    first = _add(api, f"k-{unique}")
    IdempotencyKey.objects.update(status=None, created=timezone.now() - idempotency.PENDING + timedelta(seconds=5))
    assert _add(api, f"k-{unique}", repo="org/kept-2").status_code == 409  # still within the bound: running
    IdempotencyKey.objects.update(created=timezone.now() - idempotency.PENDING - timedelta(seconds=1))
    again = _add(api, f"k-{unique}", repo="org/kept-2")  # its process died before answering: run again
    assert first.status_code == again.status_code == 202 and "Idempotent-Replayed" not in again
    assert again.json()["repo_id"] == "org/kept-2"
    assert _add(api, f"k-{unique}", repo="org/kept-3").json() == again.json()  # the new answer is the key's now
    assert IdempotencyKey.objects.count() == 1


@pytest.mark.django_db
def test_a_call_whose_key_was_taken_over_cannot_overwrite_the_new_answer():
    from plumbing import idempotency

    old = idempotency._claim("d" * 64)
    IdempotencyKey.objects.update(created=timezone.now() - idempotency.PENDING - timedelta(seconds=1))
    old.refresh_from_db()
    new = idempotency._claim("d" * 64)
    assert new is not None and new.pk == old.pk and idempotency._claim("d" * 64) is None  # one taker at a time
    assert idempotency._mine(old).update(status=202, body="{}") == 0  # the dead call's late answer: nothing
    assert idempotency._mine(new).update(status=201, body="{}") == 1


@pytest.mark.django_db
def test_a_failed_call_leaves_no_key_so_a_retry_runs(api, unique):
    with mock.patch("deployments.services.repos.model_add", autospec=True, side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError):
            _add(api, f"k-{unique}")
    assert not IdempotencyKey.objects.exists()
    assert _add(api, f"k-{unique}").status_code == 202


@pytest.mark.django_db(transaction=True)
def test_a_socket_gets_heartbeats_only_while_the_layer_holds_its_group(settings):
    settings.LIVE_HEARTBEAT_S = 0.1

    async def scenario():
        user = await sync_to_async(UserFactory)(role="viewer")
        client = Client()
        await sync_to_async(client.force_login)(user)
        ws = WebsocketCommunicator(application, "/ws/live/", headers=[
            (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()), (b"origin", b"http://localhost"),
            (b"host", b"localhost")])
        pattern = redisconn.key("group", topics.socket_group("*"))
        before = set(redisconn.client().keys(pattern))
        connected, _ = await ws.connect(timeout=30)
        assert connected
        assert await ws.receive_json_from(timeout=5) == {"beat": 0.1}
        # What Redis restarted empty does to every group, for this socket's own one (the Redis is shared).
        [own] = set(redisconn.client().keys(pattern)) - before
        redisconn.client().delete(own)
        for _ in range(3):  # a beat already in flight may still come, then none
            if await ws.receive_nothing(timeout=0.5):
                break
            await ws.receive_json_from()
        else:
            raise AssertionError("beats went on after the socket's group was gone")
        await ws.disconnect()

    run_async(scenario())


@pytest.mark.django_db
def test_a_deployment_snapshot_redis_lost_comes_from_the_database():
    d = DeploymentFactory(status="ready", status_message="serving")
    d.events.create(step="launch", message="vllm serve started")
    redisconn.client().delete(snapshots.snapshot_key(payloads.deployment_topic(d.pk)))
    messages = {m["kind"]: m["data"] for m in snapshots.on_subscribe(payloads.deployment_topic(d.pk))}
    assert messages["status"]["status"] == "ready" and messages["status"]["message"] == "serving"
    assert [v["message"] for k, v in messages.items() if k.startswith("event.")] == ["vllm serve started"]
