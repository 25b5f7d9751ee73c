"""The node list's live part (deployments/nodelive.py): heartbeats and samples are read from Redis for each
answer, on the fast lane as in Django, byte for byte; and the Redis mirror of the heartbeats never shows
what the database no longer holds (an edited node, a cleared heartbeat, a disk measured outside a heartbeat,
a mirror that missed writes while Redis was away)."""
import uuid
from datetime import timedelta

import redis
import redis.backoff
import redis.retry
from django.utils import timezone

from deployments import history, nodelive
from deployments.models import Node
from deployments.services import nodes
from plumbing import apicache, redisconn, tokens
from tests.conftest import free_port
from tests.factories import NodeFactory
from tests.test_fastlane import VARYING, get

SAMPLE = {"gpus": [], "disk": {"free": 10**12}, "host": {"ram_available": 10**9, "load1": 0.5}}


def both(base, token):
    """The node list from the lane and, at once, from Django (any other header makes it a request the lane
    never saw)."""
    lane, how = get(base, "/api/nodes/", token)
    django, how_django = get(base, "/api/nodes/", token, **{"X-Other": uuid.uuid4().hex})
    assert how == "lane" and how_django in ("hit", "miss")
    return lane, django


def test_the_lane_composes_heartbeats_and_samples_as_django_does(live_server_asgi, operator, timed):
    first, second = NodeFactory(name="n1"), NodeFactory(name="n2")
    token = tokens.issue(operator)
    for _ in range(2):
        get(live_server_asgi, "/api/nodes/", token)
    nodes.node_heartbeat(first.pk, disk_total=10**12, disk_free=3 * 10**11)
    history.push(second.pk, {"t": 5.0, **SAMPLE})
    lane, django = both(live_server_asgi, token)
    assert lane.content == django.content
    assert {k: v for k, v in lane.headers.items() if k not in VARYING} == \
        {k: v for k, v in django.headers.items() if k not in VARYING}
    shown = {n["name"]: n for n in lane.json()["results"]}
    beat = Node.objects.get(pk=first.pk).last_heartbeat
    assert shown["n1"]["last_heartbeat"] == beat.isoformat().replace("+00:00", "Z")
    assert (shown["n1"]["disk_free"], shown["n1"]["online"]) == (3 * 10**11, True)
    assert shown["n2"]["live"]["t"] == 5.0 and shown["n1"]["live"] is None


def test_online_is_decided_when_asked_from_the_heartbeat_kept(live_server_asgi, operator, timed):
    node = NodeFactory(name="n1", heartbeat_seconds=5.0)
    token = tokens.issue(operator)
    nodelive.mirror(node.pk, timezone.now() - timedelta(seconds=16), 10**12, 10**11)  # over three heartbeats ago
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=16))
    for _ in range(2):
        answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how == "lane" and answer.json()["results"][0]["online"] is False
    nodes.node_heartbeat(node.pk, disk_total=10**12, disk_free=10**11)
    answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how == "lane" and answer.json()["results"][0]["online"] is True


def test_a_node_edited_outside_a_heartbeat_shows_the_database(live_server_asgi, operator, timed):
    node = NodeFactory(name="n1")
    token = tokens.issue(operator)
    nodes.node_heartbeat(node.pk, disk_total=10**12, disk_free=10**11)
    get(live_server_asgi, "/api/nodes/", token)
    assert get(live_server_asgi, "/api/nodes/", token)[1] == "lane"
    Node.objects.filter(pk=node.pk).update(address="10.9.9.9", last_heartbeat=None)  # an edit, not a heartbeat
    answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how != "lane"
    shown = answer.json()["results"][0]
    assert (shown["address"], shown["online"], shown["last_heartbeat"]) == ("10.9.9.9", False, None)
    answer, how = get(live_server_asgi, "/api/nodes/", token)  # as Django wrote it back: a node never heard from
    assert how == "lane" and answer.json()["results"][0]["online"] is False


def test_a_disk_measured_outside_a_heartbeat_is_shown(live_server_asgi, operator, timed, tmp_path):
    from deployments import modelcopies

    node = NodeFactory(name="n1")
    token = tokens.issue(operator)
    nodes.node_heartbeat(node.pk, disk_total=1, disk_free=1)
    for _ in range(2):
        get(live_server_asgi, "/api/nodes/", token)
    modelcopies.node_refresh_disk(node, tmp_path)
    answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how != "lane" and answer.json()["results"][0]["disk_total"] > 1  # the row, read by Django
    answer, how = get(live_server_asgi, "/api/nodes/", token)  # which wrote it back for the lane
    assert how == "lane" and answer.json()["results"][0]["disk_total"] > 1


def test_a_bump_of_everything_voids_the_mirror_until_django_writes_it_back(live_server_asgi, operator, timed):
    node = NodeFactory(name="n1")
    token = tokens.issue(operator)
    nodes.node_heartbeat(node.pk, disk_total=10**12, disk_free=10**11)
    for _ in range(2):
        get(live_server_asgi, "/api/nodes/", token)
    # What a process pays once Redis is back after a heartbeat it could not mirror: the entry stays behind.
    Node.objects.filter(pk=node.pk).update(disk_free=5)
    apicache.bump(apicache.EVERYTHING)
    answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how != "lane" and answer.json()["results"][0]["disk_free"] == 5
    answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how == "lane" and answer.json()["results"][0]["disk_free"] == 5


def test_an_older_heartbeat_never_replaces_a_newer_one(db):
    node = NodeFactory(name="n1")
    now = timezone.now()
    nodelive.mirror(node.pk, now, 10, 9)
    nodelive.mirror(node.pk, now - timedelta(seconds=5), 10, 1)  # a list's late write-back, say
    found = nodelive.NODES_LIVE.read({"results": [{"id": node.pk, "heartbeat_seconds": 5.0}]})
    assert float(found[1]) == now.timestamp() and b'"disk_free":9' in found[2]


def test_a_heartbeat_while_redis_is_away_still_reaches_the_database_and_voids_the_mirror(db, monkeypatch,
                                                                                      django_capture_on_commit_callbacks):
    node = NodeFactory(name="n1")
    nodelive.mirror(node.pk, timezone.now() - timedelta(minutes=5), 10, 9)
    unreachable = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5,
                              retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    real = redisconn.client
    monkeypatch.setattr(redisconn, "client", lambda: unreachable)
    monkeypatch.setattr(apicache.debt, "owed", False)
    monkeypatch.setattr(apicache.debt, "incur", lambda: setattr(apicache.debt, "owed", True))  # no retry thread
    with django_capture_on_commit_callbacks(execute=True):
        nodes.node_heartbeat(node.pk, disk_total=10, disk_free=2)
    assert Node.objects.get(pk=node.pk).disk_free == 2 and apicache.debt.owed
    monkeypatch.setattr(redisconn, "client", real)
    apicache.debt.pay()  # Redis is back: the bump of everything
    answer = {"results": [{"id": node.pk, "heartbeat_seconds": 5.0}]}
    assert nodelive.NODES_LIVE.merge(answer, nodelive.NODES_LIVE.read(answer)) is None  # the old entry counts no more
    filled = nodelive.NODES_LIVE.fill(answer, nodelive.NODES_LIVE.read(answer))
    assert (filled["results"][0]["disk_free"], filled["results"][0]["online"]) == (2, True)


def test_without_redis_the_node_list_is_read_from_the_database(db, operator, monkeypatch):
    from rest_framework.test import APIClient

    node = NodeFactory(name="n1", heartbeat_seconds=5.0)
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now(), disk_free=7)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(operator)}")
    unreachable = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5,
                              retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    monkeypatch.setattr(redisconn, "client", lambda: unreachable)
    monkeypatch.setattr(apicache.debt, "owed", False)
    answer = api.get("/api/nodes/")
    assert answer.status_code == 200
    shown = answer.json()["results"][0]
    assert (shown["online"], shown["disk_free"], shown["live"]) == (True, 7, None)
