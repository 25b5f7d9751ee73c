"""Cached API reads (controlpanel/apicache.py) are never stale: any committed write — ORM, bulk
update, another process — a new telemetry sample, a revoked token or a lost role shows on the
very next request. And the web handler (controlpanel/handler.py) serves requests side by side."""
import subprocess
import sys
import threading
import time

import pytest
import redis
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlpanel import apicache
from deployments import history
from deployments.models import Node
from tests.conftest import ROOT, free_port
from tests.factories import DeploymentFactory, NodeFactory, UserFactory


@pytest.fixture
def api(operator):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=operator).key}")
    return client


def addresses(api) -> dict:
    response = api.get("/api/nodes/")
    assert response.status_code == 200, response.content
    return {n["name"]: n["address"] for n in response.json()["results"]}


def test_a_repeated_list_costs_no_query_and_any_write_refreshes_it(api, django_assert_num_queries):
    node = NodeFactory(name="n1", address="10.0.0.1")
    assert addresses(api) == {"n1": "10.0.0.1"}
    with django_assert_num_queries(0):  # token, role and answer all come from the cache
        assert addresses(api) == {"n1": "10.0.0.1"}

    Node.objects.filter(pk=node.pk).update(address="10.0.0.2")  # a bulk update sends no signal
    assert addresses(api) == {"n1": "10.0.0.2"}
    NodeFactory(name="n2", address="10.0.0.3")
    assert addresses(api) == {"n1": "10.0.0.2", "n2": "10.0.0.3"}
    Node.objects.filter(name="n2").delete()
    assert addresses(api) == {"n1": "10.0.0.2"}


def test_a_write_by_another_process_shows_on_the_next_read(api, process_env):
    NodeFactory(name="n1", address="10.0.0.1")
    assert addresses(api) == {"n1": "10.0.0.1"}
    code = "from deployments.models import Node; Node.objects.filter(name='n1').update(address='10.7.7.7')"
    subprocess.run([sys.executable, "manage.py", "shell", "-c", code], env=process_env, cwd=ROOT, check=True, timeout=60)
    assert addresses(api) == {"n1": "10.7.7.7"}


def test_a_new_sample_refreshes_the_live_figures_of_the_node_list(api):
    node = NodeFactory(name="n1")
    assert api.get("/api/nodes/").json()["results"][0]["live"] is None
    sample = {"t": time.time(), "gpus": [{"index": 0, "memory_used": 5, "memory_total": 10, "util_gpu": 50,
                                          "temperature_c": 40, "power_w": 100.0}],
              "disk": {"free": 1}, "host": {"ram_available": 2, "load1": 0.5}}
    history.push(node.pk, sample)
    live = api.get("/api/nodes/").json()["results"][0]["live"]
    assert live["gpus"][0]["memory_used"] == 5


def test_a_revoked_token_or_a_lost_role_counts_at_once(operator):
    client = APIClient()
    token = Token.objects.create(user=operator)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.get("/api/nodes/").status_code == 200
    assert client.get("/api/nodes/").status_code == 200
    token.delete()
    assert client.get("/api/nodes/").status_code == 401

    token = Token.objects.create(user=operator)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert client.post("/api/runs/", {}, format="json").status_code == 400  # an operator: the body is checked
    operator.groups.clear()
    assert client.post("/api/runs/", {}, format="json").status_code == 403
    assert client.get("/api/nodes/").status_code == 403


def test_a_viewer_and_an_operator_never_share_an_answer(api, db):
    viewer = UserFactory(role="viewer")
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=viewer).key}")
    NodeFactory(name="n1")
    api.get("/api/nodes/")
    other.get("/api/nodes/")
    roles = {key[2] for key in apicache.answers.entries}
    assert roles == {True, False}


def test_a_lost_version_starts_from_a_random_value():
    before = apicache.versions(apicache.ALL)
    r = apicache._redis()
    r.delete(apicache._key(apicache.DATA))
    after = apicache.versions(apicache.ALL)
    assert after[0] not in (None, before[0]) and after[1] == before[1]


def test_without_redis_reads_are_fresh_and_writes_still_work(api, monkeypatch):
    NodeFactory(name="n1", address="10.0.0.1")
    assert addresses(api) == {"n1": "10.0.0.1"}
    unreachable = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    monkeypatch.setattr(apicache, "_redis", lambda: unreachable)
    Node.objects.filter(name="n1").update(address="10.0.0.9")  # the bump fails: the write must not
    assert addresses(api) == {"n1": "10.0.0.9"}
    assert not apicache.answers.entries


def test_a_long_poll_does_not_hold_up_other_requests(live_server_asgi, operator):
    import httpx

    deployment = DeploymentFactory()
    headers = {"Authorization": f"Token {Token.objects.create(user=operator).key}"}
    url = f"{live_server_asgi}/api/deployments/{deployment.pk}/events/"
    state = httpx.get(url, headers=headers, timeout=10).json()["state"]
    answered = []
    poll = threading.Thread(target=lambda: answered.append(
        httpx.get(url, params={"state": state, "wait": 20}, headers=headers, timeout=30)))
    poll.start()
    time.sleep(0.5)  # the poll is waiting on the server now
    for _ in range(5):
        assert httpx.get(f"{live_server_asgi}/api/nodes/", headers=headers, timeout=10).status_code == 200
    assert poll.is_alive() and not answered  # the others were answered while the poll still waits
    deployment.load_percent = 42
    deployment.save()
    poll.join(30)
    assert answered and answered[0].status_code == 200


def test_the_threaded_handler_serves_static_files_pages_and_bad_requests(live_server_asgi):
    import httpx

    css = httpx.get(f"{live_server_asgi}/static/panel/panel.css", timeout=10)  # streamed from a file
    assert css.status_code == 200 and css.content == (ROOT / "static/panel/panel.css").read_bytes()
    assert httpx.get(f"{live_server_asgi}/static/panel/nope.css", timeout=10).status_code == 404
    page = httpx.get(f"{live_server_asgi}/", timeout=10)  # a page: the login redirect, through every middleware
    assert page.status_code == 302 and page.headers["location"].startswith("/accounts/login/")
    assert page.headers["x-frame-options"] == "DENY"
    assert httpx.get(f"{live_server_asgi}/healthz", headers={"host": "evil.example"}, timeout=10).status_code == 400
