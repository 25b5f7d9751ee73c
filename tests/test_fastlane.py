"""The API's fast lane (plumbing/fastlane.py): a cached answer served on the event loop is the answer Django
would give at that moment (the same body and headers), and the lane never serves past a write, a new sample,
a revoked token, a lost role, another role's answer, or a request that differs in anything but its token."""
import httpx
import pytest
import redis
from django.contrib.auth.models import Group

from deployments import history
from perf.api_latency import server_timing
from plumbing import apicache, fastlane, tokens
from tests.conftest import run_async
from tests.factories import DeploymentFactory, NodeFactory, UserFactory

VARYING = {"date", "server", "server-timing"}  # set per answer by uvicorn, or per request


def get(base, path, token, **headers):
    response = httpx.get(f"{base}{path}", headers={"Authorization": f"Token {token}", **headers}, timeout=10)
    cache = server_timing(response.headers.get("server-timing", ""), 0.0).get("cache")
    return response, cache


def test_a_repeated_read_comes_from_the_loop_with_djangos_body_and_headers(live_server_asgi, operator, timed):
    DeploymentFactory(name="d1")
    token = tokens.issue(operator)
    first, how_first = get(live_server_asgi, "/api/deployments/", token)
    second, how_second = get(live_server_asgi, "/api/deployments/", token)
    third, how_third = get(live_server_asgi, "/api/deployments/", token)
    assert (how_first, how_second, how_third) == ("miss", "lane", "lane")
    assert first.status_code == second.status_code == 200 and second.content == first.content
    assert {k: v for k, v in second.headers.items() if k not in VARYING} == \
        {k: v for k, v in first.headers.items() if k not in VARYING}
    assert [d["name"] for d in second.json()["results"]] == ["d1"]


def test_a_write_or_a_new_sample_is_seen_on_the_next_read(live_server_asgi, operator, timed):
    node = NodeFactory(name="n1", address="10.0.0.1")
    token = tokens.issue(operator)
    for _ in range(2):
        answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how == "lane" and answer.json()["results"][0]["address"] == "10.0.0.1"
    node.address = "10.0.0.2"
    node.save()
    answer, how = get(live_server_asgi, "/api/nodes/", token)
    assert how != "lane" and answer.json()["results"][0]["address"] == "10.0.0.2"
    get(live_server_asgi, "/api/nodes/", token)
    history.push(node.pk, {"t": 1.0, "gpus": [], "disk": {"free": 10**12}, "host": {"ram_available": 10**9, "load1": 7.5}})
    answer, how = get(live_server_asgi, "/api/nodes/", token)  # the live part is read for each answer, here too
    assert how == "lane" and answer.json()["results"][0]["live"]["load1"] == 7.5


def test_a_revoked_token_and_a_lost_role_are_refused_at_once(live_server_asgi, db, timed):
    viewer = UserFactory(role="viewer")
    token = tokens.issue(viewer)
    for _ in range(2):
        answer, how = get(live_server_asgi, "/api/models/", token)
    assert (answer.status_code, how) == (200, "lane")
    viewer.groups.clear()  # no role left
    assert get(live_server_asgi, "/api/models/", token)[0].status_code == 403
    viewer.groups.add(Group.objects.get(name="viewer"))
    assert get(live_server_asgi, "/api/models/", token)[0].status_code == 200
    assert get(live_server_asgi, "/api/models/", token)[1] == "lane"
    tokens.issue(viewer)  # a new token: the old one is gone
    assert get(live_server_asgi, "/api/models/", token)[0].status_code == 401


def test_each_role_gets_its_own_answer_and_a_caller_without_one_never_gets_any(live_server_asgi, operator, db, timed):
    DeploymentFactory(name="d1")
    as_operator, as_viewer = tokens.issue(operator), tokens.issue(UserFactory(role="viewer"))
    nobody = tokens.issue(UserFactory())
    for _ in range(2):
        get(live_server_asgi, "/api/deployments/", as_operator)
    answer, how = get(live_server_asgi, "/api/deployments/", as_viewer)  # the operator's answer is not the viewer's
    assert answer.status_code == 200 and how != "lane"
    assert get(live_server_asgi, "/api/deployments/", as_viewer)[1] == "lane"
    for _ in range(2):
        assert get(live_server_asgi, "/api/deployments/", nobody)[0].status_code == 403
    assert {key[1] for key in apicache.answers.entries} == {True, False}


def test_a_request_that_differs_in_anything_but_its_token_goes_to_django(live_server_asgi, operator, timed):
    token = tokens.issue(operator)
    for _ in range(2):
        get(live_server_asgi, "/api/models/", token)
    assert get(live_server_asgi, "/api/models/?page=1", token)[1] != "lane"
    assert get(live_server_asgi, "/api/models/", token, Accept="application/json; indent=2")[1] != "lane"
    page, how = get(live_server_asgi, "/api/models/", token, Accept="text/html")
    assert how is None and page.headers["content-type"].startswith("text/html")  # the browsable API, from Django


@pytest.mark.parametrize("change", [
    lambda s: {**s, "method": "POST"},
    lambda s: {**s, "path": "/nodes/"},
    lambda s: {**s, "headers": [(b"authorization", b"Bearer abc")]},
    lambda s: {**s, "headers": [(b"authorization", b"Token a"), (b"authorization", b"Token b")]},
    lambda s: {**s, "headers": [(b"authorization", b"Token abc"), (b"cookie", b"sessionid=x")]},
    lambda s: {**s, "headers": [(b"authorization", b"Token abc"), (b"content-length", b"2")]},
    lambda s: {**s, "headers": [(b"authorization", b"Token a b")]},
])
def test_what_the_lane_never_takes(change):
    scope = {"type": "http", "method": "GET", "path": "/api/models/", "query_string": b"",
             "headers": [(b"authorization", b"Token abc"), (b"accept", b"*/*")]}
    assert fastlane.shape(scope)[1] == "abc"
    assert fastlane.shape(change(scope)) == (None, None)


def test_without_redis_or_with_a_bump_owed_the_lane_vouches_for_nothing(monkeypatch, db):
    class Down:
        async def hgetall(self, key):
            raise redis.ConnectionError("down")

    async def versions():  # on a loop of its own (run_async): a browser test may own this thread's
        return await fastlane._versions()

    apicache._redis().delete(apicache._vkey())  # as after a flush
    assert run_async(versions()) is None  # missing versions: Django's path starts them
    apicache.versions()
    assert run_async(versions()) == apicache.versions()
    monkeypatch.setattr(apicache.debt, "owed", True)
    assert run_async(versions()) is None
    monkeypatch.setattr(apicache.debt, "owed", False)
    monkeypatch.setattr(fastlane, "_client", lambda: Down())
    assert run_async(versions()) is None
