"""Cached API reads (plumbing/apicache.py) are never stale: any committed write — ORM, bulk
update, another process — a new telemetry sample, a revoked token or a lost role shows on the
very next request. And the web handler (plumbing/handler.py) serves requests side by side."""
import subprocess
import sys
import threading
import time

import pytest
import redis
import redis.backoff
import redis.retry
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from deployments import history, selectors
from deployments.models import Node
from plumbing import apicache, tokens
from tests.conftest import ROOT, free_port, wait_until
from tests.factories import DeploymentFactory, NodeFactory, UserFactory


@pytest.fixture
def api(operator):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(operator)}")
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
    client.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(operator)}")
    assert client.get("/api/nodes/").status_code == 200
    assert client.get("/api/nodes/").status_code == 200
    Token.objects.filter(user=operator).delete()
    assert client.get("/api/nodes/").status_code == 401

    client.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(operator)}")
    assert client.post("/api/runs/", {}, format="json").status_code == 400  # an operator: the body is checked
    operator.groups.clear()
    assert client.post("/api/runs/", {}, format="json").status_code == 403
    assert client.get("/api/nodes/").status_code == 403


def test_a_viewer_and_an_operator_never_share_an_answer(api, db):
    viewer = UserFactory(role="viewer")
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Token {tokens.issue(viewer)}")
    NodeFactory(name="n1")
    api.get("/api/nodes/")
    other.get("/api/nodes/")
    roles = {key[1] for key in apicache.answers.entries}
    assert roles == {True, False}


def test_a_lost_version_restarts_above_any_value_it_had():
    apicache.bump("deployments_node")
    before = apicache.versions()
    apicache._redis().hdel(apicache._vkey(), "deployments_node")
    after = apicache.versions()
    assert int(after["deployments_node"]) > int(before["deployments_node"])
    assert {k: v for k, v in after.items() if k != "deployments_node"} == \
        {k: v for k, v in before.items() if k != "deployments_node"}


def test_a_write_makes_only_the_answers_that_read_its_table_stale(api, django_assert_num_queries):
    node = NodeFactory(name="n1", address="10.0.0.1")
    run_list = api.get("/api/runs/").json()
    assert addresses(api) == {"n1": "10.0.0.1"}
    Node.objects.filter(pk=node.pk).update(address="10.0.0.2")  # a heartbeat-like write to the node table
    with django_assert_num_queries(0):
        assert api.get("/api/runs/").json() == run_list  # runs read no node row: still cached
    assert addresses(api) == {"n1": "10.0.0.2"}  # the node list read it: fresh


def test_a_write_the_cache_cannot_attribute_makes_everything_stale(api):
    from django.db import connection

    NodeFactory(name="n1", address="10.0.0.1")
    assert addresses(api) == {"n1": "10.0.0.1"}
    with connection.cursor() as cursor:  # odd SQL, as a migration or a manual fix might run
        cursor.execute("WITH t AS (SELECT 1) UPDATE deployments_node SET address = '10.0.0.3'")
    assert addresses(api) == {"n1": "10.0.0.3"}


def test_without_redis_reads_are_fresh_and_writes_still_work(api, monkeypatch):
    NodeFactory(name="n1", address="10.0.0.1")
    assert addresses(api) == {"n1": "10.0.0.1"}
    everything = int(apicache.versions()[apicache.EVERYTHING])
    # No retries: redis-py's default backoff (three retries) makes each call here take ~5 s, which is not
    # what this test is about.
    unreachable = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5,
                              retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    monkeypatch.setattr(apicache, "_redis", lambda: unreachable)
    Node.objects.filter(name="n1").update(address="10.0.0.9")  # the bump fails: the write must not
    assert addresses(api) == {"n1": "10.0.0.9"}
    assert not apicache.answers.entries
    # Other processes' answers and token checks go stale as soon as Redis answers again.
    monkeypatch.undo()
    wait_until(lambda: not apicache.debt.owed, timeout=5, message="the missed write announced")
    assert int(apicache.versions()[apicache.EVERYTHING]) > everything


def test_a_long_poll_does_not_hold_up_other_requests(live_server_asgi, operator, monkeypatch):
    import httpx

    waiting, real_wait = threading.Event(), selectors.deployment_wait

    def deployment_wait(deployment, token, wait_s=0.0):  # the real long poll, noting when one is held
        if wait_s:
            waiting.set()
        return real_wait(deployment, token, wait_s)

    monkeypatch.setattr(selectors, "deployment_wait", deployment_wait)
    deployment = DeploymentFactory()
    headers = {"Authorization": f"Token {tokens.issue(operator)}"}
    url = f"{live_server_asgi}/api/deployments/{deployment.pk}/events/"
    state = httpx.get(url, headers=headers, timeout=10).json()["state"]
    answered = []
    poll = threading.Thread(target=lambda: answered.append(
        httpx.get(url, params={"state": state, "wait": 20}, headers=headers, timeout=30)))
    poll.start()
    assert waiting.wait(10), "the long poll never reached the server"
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


def test_a_heartbeat_makes_only_the_node_list_stale(api, django_assert_num_queries, django_capture_on_commit_callbacks):
    from deployments.services import nodes

    node = NodeFactory(name="n1", address="10.0.0.1")
    DeploymentFactory(node=node)
    deployments = api.get("/api/deployments/").json()
    copies = api.get("/api/copies/").json()
    assert api.get("/api/nodes/").json()["results"][0]["disk_free"] != 4 * 10**11
    with django_capture_on_commit_callbacks(execute=True):  # the agent's heartbeat commits at once
        nodes.node_heartbeat(node.pk, disk_total=10**12, disk_free=4 * 10**11)  # what each agent writes every 5 s
    with django_assert_num_queries(0):  # they show node names, never heartbeats: still cached
        assert api.get("/api/deployments/").json() == deployments
        assert api.get("/api/copies/").json() == copies
    shown = api.get("/api/nodes/").json()["results"][0]
    assert (shown["disk_free"], shown["online"]) == (4 * 10**11, True)
    assert shown["last_heartbeat"] == Node.objects.get(pk=node.pk).last_heartbeat.isoformat().replace("+00:00", "Z")
    Node.objects.filter(pk=node.pk).update(address="10.0.0.2", last_heartbeat=None)  # not a heartbeat: lists refresh
    assert addresses(api) == {"n1": "10.0.0.2"}
    assert api.get("/api/nodes/").json()["results"][0]["online"] is False


def test_the_node_list_rebuilt_for_a_sample_still_follows_its_rows(api):
    from deployments.models import Gpu
    from tests.factories import GpuFactory

    node = NodeFactory(name="n1")
    GpuFactory(node=node, index=0, memory_total=10)
    assert api.get("/api/nodes/").json()["results"][0]["gpus"][0]["memory_total"] == 10
    history.push(node.pk, {"t": time.time(), "gpus": [], "disk": {"free": 1}, "host": {"ram_available": 1, "load1": 0.0}})
    assert api.get("/api/nodes/").json()["results"][0]["live"]["disk_free"] == 1  # rebuilt around the kept rows
    Gpu.objects.filter(node=node).update(memory_total=20)
    assert api.get("/api/nodes/").json()["results"][0]["gpus"][0]["memory_total"] == 20


def test_with_server_timing_each_answer_says_where_its_time_went(live_server_asgi, operator, settings):
    """perf/api_latency.py splits latency with it: the wait for a request thread, middleware and view, the cache."""
    import httpx

    from perf.api_latency import server_timing

    headers = {"Authorization": f"Token {tokens.issue(operator)}"}
    assert "server-timing" not in httpx.get(f"{live_server_asgi}/api/nodes/", headers=headers, timeout=10).headers
    settings.SERVER_TIMING = True
    NodeFactory(name="timed")  # a write: the next list is computed, the one after comes from the cache
    first, second = (httpx.get(f"{live_server_asgi}/api/nodes/", headers=headers, timeout=10) for _ in range(2))
    timed = [server_timing(r.headers["server-timing"], 1000.0) for r in (first, second)]
    assert [t["cache"] for t in timed] == ["miss", "lane"]  # the second on the event loop (plumbing/fastlane.py)
    assert timed[0]["wait"] >= 0 and timed[0]["app"] > 0 and timed[1]["lane"] > 0
    assert "cache" not in server_timing(httpx.get(f"{live_server_asgi}/healthz", timeout=10).headers["server-timing"], 1.0)
