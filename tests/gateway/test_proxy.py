"""The gateway in a thread against known-schedule servers: what callers see on every path."""
import datetime as dt
import json
import threading
import time

import httpx
import pytest
from django.db.models import Sum
from django.utils import timezone

from deployments import scrapekey
from deployments.gateway import peers
from deployments.gateway import reload as gateway_reload
from deployments.gateway.server import FORWARDED
from deployments.gateway.models import CallerKey, Usage
from deployments.models import Deployment, Node
from tests.conftest import free_port, wait_until
from tests.gateway.conftest import GatewayThread, make_deployment, make_key
from tests.schedserver import SchedServer

CHAT = {"model": "sched", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 8}


def post(gw, key, body, path="/v1/chat/completions", **kw):
    return httpx.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, **{"timeout": 30, **kw})


def events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def usage_totals(**filters):
    return Usage.objects.filter(**filters).aggregate(
        requests=Sum("requests"), errors=Sum("errors"), prompt=Sum("prompt_tokens"),
        reasoning=Sum("reasoning_tokens"), content=Sum("content_tokens"))


def refusals(**filters) -> dict:
    """Requests, errors and refusals for load (429s) the gateway counted."""
    return Usage.objects.filter(**filters).aggregate(requests=Sum("requests"), errors=Sum("errors"),
                                                     refused=Sum("refused"))


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_stream_passes_through_without_the_usage_chunk_the_caller_did_not_ask_for(node, sched, gateway):
    make_deployment(node, sched.port)
    key = make_key()
    gateway.reload()
    reply = post(gateway, key, {**CHAT, "stream": True})
    assert reply.status_code == 200
    chunks = events(reply.text)
    assert chunks and all(c["choices"] for c in chunks) and not any(c.get("usage") for c in chunks)
    assert reply.text.rstrip().endswith("data: [DONE]")
    asked = post(gateway, key, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert events(asked.text)[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 11, "completion_tokens": 8,
                                               "completion_tokens_details": {"reasoning_tokens": 3}}
    key_id = CallerKey.objects.get(prefix=key[:12]).pk
    totals = wait_for(lambda: (t := usage_totals(key_id=key_id))["requests"] == 2 and t)
    assert totals == {"requests": 2, "errors": 0, "prompt": 6, "reasoning": 6, "content": 10}
    assert CallerKey.objects.get(pk=key_id).last_used_at is not None


def test_plain_chat_and_completions_answer_and_count_the_engines_usage(node, sched, gateway):
    make_deployment(node, sched.port)
    key = make_key()
    gateway.reload()
    chat = post(gateway, key, CHAT)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
    text = post(gateway, key, {"model": "sched", "prompt": "a b", "max_tokens": 4}, "/v1/completions")
    assert text.status_code == 200 and text.json()["choices"][0]["text"] == "w " * 4
    streamed = post(gateway, key, {"model": "sched", "prompt": "a b", "max_tokens": 4, "stream": True},
                    "/v1/completions")
    assert "".join(c["choices"][0]["text"] for c in events(streamed.text)) == "w " * 4
    totals = wait_for(lambda: (t := usage_totals())["requests"] == 3 and t)
    # schedserver's plain answers carry no completion_tokens_details: all 8 chat tokens are content then
    assert totals == {"requests": 3, "errors": 0, "prompt": 3 + 2 + 2, "reasoning": 0, "content": 8 + 4 + 4}


@pytest.mark.parametrize("method, path", [
    ("GET", "/health"), ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/pause"), ("POST", "/update_weights"),
    ("POST", "/scale_elastic_ep"), ("POST", "/invocations"), ("GET", "/stats"), ("POST", "/v1/models"),
    ("GET", "/v1/chat/completions"), ("GET", "/v1/models/sched"), ("POST", "/v1/chat/completions/"),
])
def test_every_path_outside_the_openai_api_is_404(node, sched, gateway, method, path):
    make_deployment(node, sched.port)
    key = make_key()
    gateway.reload()
    reply = httpx.request(method, gateway.url + path, headers={"Authorization": f"Bearer {key}"}, json=CHAT)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "not_found"


def test_keys_that_do_not_hold_are_refused_the_openai_way(node, sched, gateway):
    d = make_deployment(node, sched.port, aliases=["kimi"])
    other = make_deployment(node, sched.port, served="other")
    past = timezone.now() - dt.timedelta(seconds=1)
    keys = {"expired": make_key(expires_at=past), "revoked": make_key(revoked_at=past),
            "names": make_key(model_names=["other"]), "deployments": make_key(deployments=[other]),
            "good": make_key(model_names=["kimi"], expires_at=timezone.now() + dt.timedelta(hours=1))}
    gateway.reload()
    cases = {"missing": (None, 401), "wrong": ("vcp-" + "x" * 43, 401), "expired": (keys["expired"], 401),
             "revoked": (keys["revoked"], 401), "names": (keys["names"], 403), "deployments": (keys["deployments"], 403)}
    for case, (secret, status) in cases.items():
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        reply = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "model": "kimi"}, headers=headers)
        assert reply.status_code == status, case
        error = reply.json()["error"]
        assert error["code"] and error["message"] and "type" in error, case
        assert not secret or secret not in reply.text
    assert post(gateway, keys["good"], {**CHAT, "model": "kimi"}).status_code == 200
    assert post(gateway, keys["good"], {**CHAT, "model": "sched"}).status_code == 403  # not in its names
    assert post(gateway, keys["good"], {**CHAT, "model": "nobody"}).status_code == 404
    assert d.pk != other.pk


def test_models_lists_the_names_the_key_may_call(node, sched, gateway):
    make_deployment(node, sched.port, aliases=["kimi"])
    make_deployment(node, sched.port, served="other")
    scoped, anyone = make_key(model_names=["kimi"]), make_key()
    gateway.reload()

    def names(key):
        reply = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        return [m["id"] for m in reply.json()["data"]]

    assert names(scoped) == ["kimi"]
    assert names(anyone) == ["kimi", "other", "sched"]
    assert httpx.get(gateway.url + "/v1/models").status_code == 401


def test_an_alias_reaches_the_engine_under_its_served_name(node, sched, gateway):
    make_deployment(node, sched.port, aliases=["kimi"])
    key = make_key()
    gateway.reload()
    reply = post(gateway, key, {**CHAT, "model": "kimi"})
    assert reply.status_code == 200 and reply.json()["model"] == "sched"  # schedserver echoes the model it got
    assert wait_for(lambda: Usage.objects.filter(model_name="kimi").exists())


def test_rps_limit_answers_429_with_retry_after(node, sched, gateway, monkeypatch):
    """The limiter's clock is the test's: a host so busy that each request took longer than the refill (CI: ten
    200s in a row at 2/s) cannot make the refusal a race."""
    from deployments.gateway import limits

    now = [1000.0]
    monkeypatch.setattr(limits, "clock", lambda: now[0])
    make_deployment(node, sched.port)
    key = make_key(rps_limit=2)
    gateway.reload()
    codes = [post(gateway, key, CHAT).status_code for _ in range(3)]  # a burst of two passes, the third waits
    assert codes == [200, 200, 429], codes
    refused = post(gateway, key, CHAT)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.headers["retry-after-ms"] == "500"  # one token at 2/s
    now[0] += 0.5
    assert post(gateway, key, CHAT).status_code == 200
    assert post(gateway, key, CHAT).status_code == 429
    counted = wait_for(lambda: (t := refusals(key__prefix=key[:12])) and t["requests"] == 6 and t)
    assert (counted["errors"], counted["refused"]) == (3, 3), counted  # each 429 counted refused, per key


def test_concurrency_and_token_limits_answer_429(node, gateway):
    # The first request is still at the server when the second is sent (waited for, not slept on: a busy host
    # reached the gateway later than a fixed 0.1 s), and stays there 3 s.
    with SchedServer(ttft_ms=3000, gap_ms=1, default_max_tokens=4) as slow:
        make_deployment(node, slow.port)
        one_at_a_time, budget = make_key(max_concurrency=1), make_key(tpm_limit=10)
        gateway.reload()
        first = threading.Thread(target=post, args=(gateway, one_at_a_time, CHAT))
        first.start()
        wait_until(lambda: slow.server.requests_total == 1, timeout=30, interval=0.01, message="the first request in flight")
        assert post(gateway, one_at_a_time, CHAT).status_code == 429
        first.join()
        assert post(gateway, budget, CHAT).status_code == 200  # 3 + 8 tokens: over 10 now
        over = post(gateway, budget, CHAT)
        assert over.status_code == 429 and 55 <= int(over.headers["Retry-After"]) <= 60


def test_a_stream_asked_for_in_a_string_is_counted_and_limited_as_the_engine_streams_it(node, sched, gateway):
    """vLLM reads "stream": "true" (and 1, "on", "yes") as a stream; the gateway read it as a plain answer, found
    no usage in it and counted 0 tokens, so a key limited to 40 tokens a minute ran unlimited."""
    make_deployment(node, sched.port)
    key, other = make_key(tpm_limit=40), make_key()
    key_id = CallerKey.objects.get(prefix=key[:12]).pk
    gateway.reload()
    body = {**CHAT, "max_tokens": 26}  # 3 prompt + 26 completion tokens
    first = post(gateway, key, {**body, "stream": "true"})
    assert first.status_code == 200 and first.headers["Content-Type"].startswith("text/event-stream")
    assert not any(c.get("usage") for c in events(first.text))  # the caller did not ask for usage
    assert post(gateway, key, {**body, "stream": "on", "stream_options": {"include_usage": "false"}}).status_code == 200
    refused = post(gateway, key, {**body, "stream": "yes"})  # 58 tokens used: over 40
    assert refused.status_code == 429, refused.text
    totals = wait_for(lambda: (t := usage_totals(key_id=key_id))["requests"] == 3 and t)
    assert totals["prompt"] == 6 and totals["reasoning"] + totals["content"] == 52
    bad = post(gateway, other, {**body, "stream": "maybe"})  # what vLLM refuses, refused here
    assert bad.status_code == 400 and bad.json()["error"]["message"] == '"stream" must be true or false.'


def test_a_stream_the_caller_cuts_before_its_usage_event_is_counted_and_limited(node, gateway):
    """Closing a stream before its last event (where the usage is) made it free: now each event forwarded counts a
    token and the prompt its text's estimate, so the key's limit holds."""
    with SchedServer(ttft_ms=10, gap_ms=50, default_max_tokens=200) as slow:
        make_deployment(node, slow.port)
        key = make_key(tpm_limit=40)
        key_id = CallerKey.objects.get(prefix=key[:12]).pk
        gateway.reload()
        cut = 0
        for _ in range(2):
            with httpx.stream("POST", gateway.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 200,
                              "stream": True}, headers={"Authorization": f"Bearer {key}"}, timeout=30) as reply:
                assert reply.status_code == 200
                read = 0
                for line in reply.iter_lines():
                    read += line.startswith("data: {")
                    if read == 25:
                        break  # and the connection closes, the usage event 175 tokens away
            cut += 1
            wait_for(lambda: (usage_totals(key_id=key_id)["requests"] or 0) == cut)
        totals = usage_totals(key_id=key_id)
        assert totals["errors"] == 2  # cut short
        assert totals["reasoning"] + totals["content"] >= 2 * 25 and totals["prompt"] >= 2
        over = post(gateway, key, {**CHAT, "max_tokens": 2})
        assert over.status_code == 429 and "tokens per minute" in over.json()["error"]["message"]


def test_a_full_deployment_queue_answers_429(node, gateway):
    """One in flight, one waiting, the next refused. Each request goes once the one before is where it should be (at
    the engine, in the queue): three sent 50 ms apart all got 200 on a busy host, the first done before the third."""
    with SchedServer(ttft_ms=3000, gap_ms=1, default_max_tokens=2) as slow:
        d = make_deployment(node, slow.port, max_in_flight=1, queue_bound=1)
        key = make_key()
        gateway.reload()
        codes = []
        threads = [threading.Thread(target=lambda: codes.append(post(gateway, key, CHAT).status_code)) for _ in range(2)]
        threads[0].start()
        wait_for(lambda: slow.server.requests_total == 1)  # in flight at the engine
        threads[1].start()
        wait_for(lambda: (a := gateway.gateway.admissions.get(d.pk)) is not None and len(a.waiters) == 1)  # queued
        refused = post(gateway, key, CHAT)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "deployment_busy", refused.text
        for t in threads:
            t.join()
        assert codes == [200, 200] and slow.server.requests_total == 2  # the refused one never reached the engine


def test_no_ready_deployment_waits_then_answers_503_and_follows_one_that_becomes_ready(node, sched, gateway):
    d = make_deployment(node, sched.port, status=Deployment.Status.LOADING)
    key = make_key()
    gateway.reload()
    started = time.monotonic()
    reply = post(gateway, key, CHAT)
    assert reply.status_code == 503 and int(reply.headers["Retry-After"]) >= 1
    assert time.monotonic() - started >= 1.9  # the gateway's ready wait (2 s here)
    result = {}
    gateway.gateway.ready_wait_s = 60.0  # no clock below: the deployment becomes ready while the request waits
    waiter = threading.Thread(target=lambda: result.setdefault("reply", post(gateway, key, CHAT, timeout=90)))
    waiter.start()
    wait_for(lambda: gateway.gateway.waiting.get(CHAT["model"]) == 1)
    Deployment.objects.filter(pk=d.pk).update(status=Deployment.Status.READY)
    gateway.reload()
    waiter.join()
    assert result["reply"].status_code == 200


def test_a_refused_connection_goes_to_the_other_ready_deployment(node, sched, gateway):
    make_deployment(node, free_port(), aliases=["kimi"])  # nothing listens there
    make_deployment(node, sched.port, aliases=["kimi"])
    key = make_key()
    gateway.reload()
    assert all(post(gateway, key, {**CHAT, "model": "kimi"}).status_code == 200 for _ in range(4))


def test_media_urls_only_from_the_routes_domains(node, sched, gateway):
    make_deployment(node, sched.port, media_domains=["images.example.com"])
    key = make_key()
    gateway.reload()

    def ask(url):
        part = {"type": "image_url", "image_url": {"url": url}}
        return post(gateway, key, {**CHAT, "messages": [{"role": "user", "content": [part]}]}).status_code

    assert ask("https://images.example.com/cat.png") == 200
    assert ask("https://cdn.images.example.com/cat.png") == 400  # vLLM's rule: the host, exactly
    assert ask("data:image/png;base64,iVBORw0KGgo=") == 200
    assert ask("http://169.254.169.254/latest/meta-data") == 400
    assert ask("https://images.example.com.evil.org/x.png") == 400
    assert ask("file:///etc/passwd") == 400


def test_engine_metrics_open_to_the_scrape_token_only_and_it_opens_nothing_else(node, sched, gateway):
    d = make_deployment(node, sched.port)
    scrape = make_key(internal=True, name=scrapekey.NAME)
    caller = make_key()
    Node.objects.create(name="gw-peer", address="127.0.0.1")
    gateway.reload()
    url = f"{gateway.url}/engines/{d.pk}/metrics"
    reply = httpx.get(url, headers={"Authorization": f"Bearer {scrape}"})
    assert reply.status_code == 200 and "vllm:num_requests_running" in reply.text
    assert httpx.get(url, headers={"Authorization": f"Bearer {caller}"}).status_code == 403
    peer = {"Authorization": f"Bearer {peers.current('gw-peer', node.name)}", peers.HEADER: "gw-peer"}
    assert httpx.get(url, headers=peer).status_code == 403  # a peer gateway's key of the hour
    assert httpx.get(url).status_code == 401
    assert httpx.get(f"{gateway.url}/engines/999999/metrics", headers={"Authorization": f"Bearer {scrape}"}).status_code == 404
    # The scrape token on every inference path and the model list: refused, and nothing reached the engine.
    served = sched.server.requests_total
    for path in sorted(FORWARDED):
        refused = httpx.post(gateway.url + path, json={**CHAT, "stream": True}, headers={"Authorization": f"Bearer {scrape}"})
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["message"] == "The scrape token opens engine metrics only: send a caller key."
    assert httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {scrape}"}).status_code == 403
    assert sched.server.requests_total == served
    assert not Usage.objects.filter(key__name=scrapekey.NAME).exists()
    assert post(gateway, caller, CHAT).status_code == 200  # and a caller's key still works


def test_the_gateway_reports_its_port_and_health(node, gateway):
    assert Node.objects.get(pk=node.pk).gateway_port == gateway.gateway.port
    assert httpx.get(gateway.url + "/healthz").json()["status"] == "ok"


def test_a_revoked_key_is_refused_after_the_next_poll(node, sched, monkeypatch):
    """The polls are driven here (the gateway's own never comes), each reading the database's stamps: a revocation
    no one announced (Redis cannot say) is read by the next poll, and the very next request is refused."""
    monkeypatch.setattr(gateway_reload, "STAMPS_S", 0.0)
    make_deployment(node, sched.port)
    key = make_key()
    with GatewayThread(node.name, ready_wait_s=1.0, poll_s=3600) as gw:
        assert post(gw, key, CHAT).status_code == 200
        # Polls until nothing changes (the gateway's own start writes its port into the node's row).
        assert any(not gw.call(gw.gateway.watcher.tick()) for _ in range(3))
        CallerKey.objects.filter(prefix=key[:12]).update(revoked_at=timezone.now())
        # Keys are checked against the snapshot, never the database per request: until a poll, the key still works.
        assert post(gw, key, CHAT).status_code == 200
        assert gw.call(gw.gateway.watcher.tick()) is True
        refused = post(gw, key, CHAT)
        assert refused.status_code == 401 and "has been revoked" in refused.json()["error"]["message"]


def test_a_deployment_on_another_node_is_reached_through_that_nodes_gateway(node, sched):
    other = Node.objects.create(name="gw-other", address="127.0.0.1")
    d = make_deployment(other, sched.port, aliases=["far"])
    key = make_key()
    with GatewayThread(other.name, ready_wait_s=1.0) as there, GatewayThread(node.name, ready_wait_s=1.0) as here:
        here.reload()  # after the other gateway wrote its port into its node's row
        reply = post(here, key, {**CHAT, "model": "far", "stream": True})
        assert reply.status_code == 200 and not any(c.get("usage") for c in events(reply.text))
        assert post(here, key, {**CHAT, "model": "far"}).status_code == 200
        assert there.gateway.port != here.gateway.port
    # Counted once, by the gateway the caller called, under the caller's key and the remote deployment.
    key_id = CallerKey.objects.get(prefix=key[:12]).pk
    assert usage_totals(key_id=key_id)["requests"] == 2
    assert usage_totals(deployment=d)["requests"] == 2
    assert not Usage.objects.filter(key__internal=True).exists()


def test_streams_that_end_together_leave_every_engine_connection_open_for_the_next_ones(node, gateway):
    """A batch of streams started together ends in the same engine step, so all their connections come back to
    the gateway at once; every one is kept for the next requests instead of being closed and opened again."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import aiohttp

    streams = 160

    async def wave(key):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one():
                async with session.post(gateway.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                        json={"model": "sched", "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
                    assert r.status == 200
                    await r.read()
            await asyncio.gather(*(one() for _ in range(streams)))

    async def idle():
        return sum(len(conns) for conns in gateway.gateway.pool.idle.values())

    # The first token comes long after the last stream can have opened, even on a loaded machine (at 300 ms a
    # slow client let early streams end first, and fewer connections were ever open at once).
    with SchedServer(ttft_ms=3000, gap_ms=5, default_max_tokens=4) as slow:
        make_deployment(node, slow.port, max_in_flight=streams)
        key = make_key()
        gateway.reload()
        client = ThreadPoolExecutor(1)  # its own event loop: a browser test before this one leaves one running here
        client.submit(asyncio.run, wave(key)).result(60)
        assert gateway.call(idle()) == streams
        client.submit(asyncio.run, wave(key)).result(60)
        assert gateway.call(idle()) == streams  # the second wave reused them: none opened, none closed


def test_an_engines_admission_refusal_reaches_the_caller_as_429_with_retry_after(node, gateway):
    """vLLM with --max-num-queued-reqs answers 503 "currently busy" past its cap, which clients read as "down"; the
    gateway answers it as its own overload: 429 with Retry-After, the engine's words kept, streamed or not."""
    with SchedServer(ttft_ms=5, gap_ms=50, reasoning_tokens=0, max_num_queued_reqs=1) as capped:
        make_deployment(node, capped.port)
        key = make_key()
        gateway.reload()
        holder = threading.Thread(target=post, args=(gateway, key, {**CHAT, "max_tokens": 60, "stream": True}))
        holder.start()
        wait_for(lambda: capped.server.unfinished == 1)
        for body in (CHAT, {**CHAT, "stream": True}):
            refused = post(gateway, key, body)
            assert (refused.status_code, refused.headers.get("Retry-After")) == (429, "1"), refused.text
            assert refused.json()["error"]["message"].startswith("The engine is currently busy")
        holder.join(30)
        assert capped.server.admission_rejections == 2
        counted = wait_for(lambda: (t := refusals(key__prefix=key[:12])) and t["requests"] == 3 and t)
        assert (counted["errors"], counted["refused"]) == (2, 2), counted
        assert post(gateway, key, CHAT).status_code == 200, "the queue drained: admitted again"


def test_an_admission_refusal_inside_the_engines_200_stream_reaches_the_caller_as_429(node, gateway):
    """vLLM checks its cap again as it adds a request, after a stream's 200 has gone: of two streams that passed the
    first check together, the second gets a 200 whose only event is the 503's error. The gateway holds the caller's
    head until the first event, so the caller gets the same 429 with Retry-After as for the engine's 503."""
    # 2 s between the engine's two checks, and the one admitted takes 2 s: a second stream within 2 s of it is refused
    # at its second check.
    with SchedServer(ttft_ms=5, gap_ms=100, reasoning_tokens=0, max_num_queued_reqs=1, admission_gap_ms=2000) as capped:
        make_deployment(node, capped.port)
        key = make_key()
        gateway.reload()
        replies = []
        both = [threading.Thread(target=lambda: replies.append(post(gateway, key, {**CHAT, "stream": True,
                                                                                     "max_tokens": 20})))
                for _ in range(2)]
        for t in both:
            t.start()
        for t in both:
            t.join(30)
        assert capped.server.admission_rejections == 1  # the second check's: both passed the first
        served, refused = sorted(replies, key=lambda r: r.status_code)
        assert served.status_code == 200 and events(served.text) and "error" not in served.text
        assert (refused.status_code, refused.headers.get("Retry-After")) == (429, "1"), refused.text
        assert refused.json()["error"]["message"].startswith("The engine is currently busy")
        counted = wait_for(lambda: (t := refusals(key__prefix=key[:12])) and t["requests"] == 2 and t)
        assert (counted["errors"], counted["refused"]) == (1, 1), counted
