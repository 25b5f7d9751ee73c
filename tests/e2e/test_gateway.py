"""End to end: the node gateway as its own process (`manage.py gateway`) in front of the real CPU vLLM (with its
engine key and a reasoning parser) and of known-schedule servers (tests/schedserver.py)."""
import asyncio
import contextlib
import datetime
import json
import os
import re
import secrets
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from django.db.models import Sum
from django.utils import timezone

from deployments.gateway import changes
from deployments.gateway.models import CallerKey, Usage
from deployments.host import door, processes, processlog, serveargv, vllm
from deployments.models import Deployment
from tests.conftest import VLLM, free_port, run_async, wait_until
from tests.factories import NodeFactory
from tests.gateway.conftest import make_deployment, make_key
from tests.schedserver import SchedServer

START_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM.exists(), reason=f"no engine at {VLLM}: run scripts/install-engine"),
]


@contextlib.contextmanager
def engine_on_loopback(tiny_model, tmp: Path, **flags):
    """The CPU engine on loopback with an engine key (VLLM_API_KEY) and `flags`, up: (port, key); stopped after."""
    port, key = free_port(), secrets.token_urlsafe(32)
    argv = serveargv.build_argv(str(VLLM), str(tiny_model), port, "127.0.0.1", {
        "enforce-eager": True, "max-model-len": 1024, "served-model-name": "tiny", **flags})
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "VLLM_API_KEY": key}
    log_path = tmp / "engine.log"
    handle = processes.launch(processes.EngineSpec(argv, env, log_path, cwd=tmp))
    base, started = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while not vllm.health(base):
            if not processes.alive(handle.pid, handle.create_time):
                pytest.fail("engine exited while starting:\n" + "\n".join(processlog.tail(log_path, 40)))
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail("engine not up:\n" + "\n".join(processlog.tail(log_path, 40)))
            time.sleep(0.3)
        yield port, key
    finally:
        processes.stop(handle.pgid, term_timeout_s=5.0)


@pytest.fixture(scope="module")
def cpu_engine(tiny_model, tmp_path_factory):
    """The CPU engine with the qwen3 reasoning parser: (port, key)."""
    with engine_on_loopback(tiny_model, tmp_path_factory.mktemp("gw-engine"), **{"reasoning-parser": "qwen3",
                                                                               "max-num-seqs": 32}) as engine:
        yield engine


def start_gateway(spawn, env, node_name: str, ready_wait: float = 5.0, host: str = "127.0.0.1") -> str:
    """`manage.py gateway` for `node_name` on `host` and a free port; its base URL once it says it listens. Pass
    the node's registered address where callers are given the node's URL (pages, Prometheus discovery)."""
    proc = spawn([sys.executable, "manage.py", "gateway", "--node", node_name, "--host", host, "--port", "0",
                  "--ready-wait", str(ready_wait)], env, name="gateway")
    found = wait_until(lambda: re.search(rb"listening on http://" + re.escape(host.encode()) + rb":(\d+)",
                                         Path(proc.log_path).read_bytes()),
                       timeout=60, message="the gateway to listen")
    return f"http://{host}:{int(found.group(1))}"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _texts(output: list) -> list:
    return [part.get("text") for item in output for part in item.get("content") or []]


# What differs between two answers that are the same: their ids, times and the count of their events.
VOLATILE = frozenset({"id", "created", "created_at", "item_id", "response_id", "system_fingerprint", "sequence_number"})
JOINED = frozenset({"content", "text", "reasoning", "reasoning_content", "refusal", "delta"})  # streamed in pieces


def _fold(into: dict, part: dict) -> dict:
    """`part` merged into `into`: streamed text joined, list items by their index, any other field its last value."""
    for key, value in part.items():
        if key in VOLATILE or value is None:
            continue
        if isinstance(value, str) and key in JOINED:
            into[key] = into.get(key, "") + value
        elif isinstance(value, dict):
            _fold(into.setdefault(key, {}), value)
        elif isinstance(value, list) and all(isinstance(v, dict) for v in value):  # [] adds nothing
            items = into.setdefault(key, {})
            for i, item in enumerate(value):
                _fold(items.setdefault(item.get("index", i), {}), item)
        else:
            into[key] = value
    return into


def _answer(text: str) -> dict:
    """A streamed reply whole, however its tokens were grouped into events (tokens that come while the engine's server
    is busy go out together): each event kind's payloads folded (_fold), the kinds in their order, [DONE] or not."""
    kinds, folded, done = [], {}, False
    for line in text.splitlines():
        if line.startswith("event:") and line not in kinds:
            kinds.append(line)
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
            else:
                event = json.loads(data)
                _fold(folded.setdefault(event.get("type", ""), {}), event)
    return {"kinds": kinds, "events": folded, "done": done}


def totals(**filters) -> dict:
    return Usage.objects.filter(**filters).aggregate(
        requests=Sum("requests"), errors=Sum("errors"), prompt=Sum("prompt_tokens"),
        reasoning=Sum("reasoning_tokens"), content=Sum("content_tokens"))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}
TEXT = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
RESPONSES = {"model": "tiny", "input": "What is the capital of France?", "max_output_tokens": 16, "temperature": 0}
EMBED = {"model": "tiny", "input": "hello"}


def test_every_openai_route_answers_through_the_gateway_as_the_engine_does(cpu_engine, process_env, spawn):
    port, engine_key = cpu_engine
    node = NodeFactory(name="gw-e2e", address="127.0.0.1")
    make_deployment(node, port, served="tiny", aliases=["paris"], engine_key=engine_key)
    key = make_key()
    gateway = start_gateway(spawn, process_env, node.name)
    direct = f"http://127.0.0.1:{port}"
    assert httpx.post(direct + "/v1/completions", json=TEXT).status_code == 401  # the engine wants its key
    with httpx.Client(timeout=120) as client:
        for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT), ("/v1/responses", RESPONSES),
                           ("/v1/embeddings", EMBED)]:
            for stream in (False, True) if path != "/v1/embeddings" else (False,):
                sent = {**body, "stream": True} if stream else body
                mine = client.post(direct + path, json=sent, headers=bearer(engine_key))
                theirs = client.post(gateway + path, json={**sent, "model": "paris"}, headers=bearer(key))
                assert theirs.status_code == mine.status_code, (path, stream, theirs.text[:300])
                if mine.status_code != 200:
                    assert path == "/v1/embeddings"  # the tiny model generates: the engine's own refusal passes
                    assert theirs.json() == mine.json()
                    continue
                if stream:  # temperature 0: the same events, token by token, to the end
                    assert theirs.text.rstrip().endswith("data: [DONE]") or "response.completed" in theirs.text
                    assert _answer(theirs.text) == _answer(mine.text), (path, theirs.text)
                elif path == "/v1/responses":  # temperature 0: the same answer (items get ids of their own)
                    assert _texts(theirs.json()["output"]) == _texts(mine.json()["output"]) != []
                else:
                    assert theirs.json()["choices"] == mine.json()["choices"]
        models = client.get(gateway + "/v1/models", headers=bearer(key)).json()
        assert [m["id"] for m in models["data"]] == ["paris", "tiny"]


def test_vllm_routes_outside_the_openai_api_are_404_through_the_gateway(cpu_engine, process_env, spawn):
    port, engine_key = cpu_engine
    node = NodeFactory(name="gw-e2e-404", address="127.0.0.1")
    make_deployment(node, port, served="tiny", engine_key=engine_key)
    key = make_key()
    gateway = start_gateway(spawn, process_env, node.name)
    direct = f"http://127.0.0.1:{port}"
    # Harmless to ask the engine itself: they exist there.
    for method, path, body in [("GET", "/version", None), ("GET", "/health", None), ("GET", "/metrics", None),
                               ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}), ("GET", "/ping", None),
                               ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2]})]:
        assert httpx.request(method, direct + path, json=body, headers=bearer(engine_key)).status_code != 404, path
        assert httpx.request(method, gateway + path, json=body, headers=bearer(key)).status_code == 404, path
    # Never asked of the engine here (they would pause it, change its weights, ...): 404 at the gateway.
    for path in ["/pause", "/resume", "/update_weights", "/scale_elastic_ep", "/invocations", "/sleep", "/wake_up",
                 "/reset_prefix_cache", "/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                 "/pooling", "/classify", "/score", "/rerank", "/v1/rerank", "/v1/score", "/v1/audio/transcriptions",
                 "/server_info", "/is_sleeping", "/start_profile", "/stop_profile", "/v1/completions/render",
                 "/v1/chat/completions/render", "/inference/v1/generate"]:
        assert httpx.post(gateway + path, json={"model": "tiny"}, headers=bearer(key)).status_code == 404, path


@pytest.mark.tools  # nftables: ./panel test installs it
@pytest.mark.skipif(os.geteuid() != 0, reason="nftables and another uid need root")
def test_behind_the_door_no_route_of_the_real_engine_answers_another_uid_and_the_gateway_still_serves(
        cpu_engine, process_env, spawn, monkeypatch):
    """vLLM 0.32 keys only /v1 (and a few prefixes): /invocations and /tokenize answered `nobody` without a key.
    The door (host/firewall.py) refuses the connection itself, so no route answers, dev routes included; the
    gateway (the agent's uid) still serves with a caller's key."""
    port, engine_key = cpu_engine
    routes = ["/invocations", "/tokenize", "/v1/chat/completions", "/collective_rpc", "/pause", "/metrics", "/health"]
    before = door.ask_as(door.NOBODY, {port: routes})[port]
    assert before["/v1/chat/completions"] == 401, before  # keyed
    for route in ("/invocations", "/tokenize", "/metrics", "/health"):  # not keyed: reachable by any local user
        assert isinstance(before[route], int) and before[route] not in (401, 403, 404), (route, before)
    monkeypatch.setattr(door, "_door", None)
    door.shut(port, "gw-e2e-door")
    try:
        after = door.ask_as(door.NOBODY, {port: routes})[port]
        assert set(after.values()) == {"ConnectionRefusedError"}, after
        node = NodeFactory(name="gw-e2e-door", address="127.0.0.1")
        make_deployment(node, port, served="tiny", engine_key=engine_key)
        key = make_key()
        gateway = start_gateway(spawn, process_env, node.name)
        reply = httpx.post(gateway + "/v1/chat/completions", json=CHAT, headers=bearer(key), timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
    finally:
        door.reopen(port, "gw-e2e-door")


def test_usage_matches_the_engines_own_usage_fields_exactly(cpu_engine, process_env, spawn):
    port, engine_key = cpu_engine
    node = NodeFactory(name="gw-e2e-usage", address="127.0.0.1")
    d = make_deployment(node, port, served="tiny", engine_key=engine_key)
    key = make_key()
    gateway = start_gateway(spawn, process_env, node.name)
    direct = f"http://127.0.0.1:{port}"
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    expected = {"requests": 0, "errors": 0, "prompt": 0, "reasoning": 0, "content": 0}
    completion = 0  # the engine's completion_tokens, summed: what reasoning + content must add up to
    with httpx.Client(timeout=120) as client:
        for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]:
            for variant in ({}, {"stream": True}, asked):
                reply = client.post(gateway + path, json={**body, **variant}, headers=bearer(key))
                assert reply.status_code == 200
                if variant.get("stream"):
                    chunks = sse(reply.text)
                    usage_chunks = [c for c in chunks if c.get("usage")]
                    assert len(usage_chunks) == (1 if variant is asked else 0)  # stripped unless asked for
                # The engine's own count of the same request (temperature 0: the same tokens), asked directly.
                own = client.post(direct + path, json={**body, "stream": False}, headers=bearer(engine_key)).json()
                usage = own["usage"]
                if variant is asked:
                    fields = ("prompt_tokens", "completion_tokens", "total_tokens", "completion_tokens_details")
                    assert {f: usage_chunks[0]["usage"].get(f) for f in fields} == {f: usage.get(f) for f in fields}
                if path == "/v1/chat/completions":  # the parser is on: the engine reports a count, 0 included
                    assert isinstance((usage.get("completion_tokens_details") or {}).get("reasoning_tokens"), int)
                reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
                completion += usage["completion_tokens"]
                expected["requests"] += 1
                expected["prompt"] += usage["prompt_tokens"]
                expected["reasoning"] += reasoning
                expected["content"] += usage["completion_tokens"] - reasoning
    print("engine usage:", expected)
    assert expected["content"] > 0
    wait_until(lambda: totals(deployment=d)["requests"] == expected["requests"], timeout=10, message="usage flushed")
    counted = totals(deployment=d)
    assert counted["reasoning"] + counted["content"] == completion
    assert counted == expected


def test_a_multi_turn_workload_shows_the_engines_own_prefix_cache_hits(cpu_engine):
    """The runner straight at the engine (prefix caching is on by default in vLLM V1): each turn resends the
    history, and the engine's own counters (vllm:prefix_cache_queries/hits) show hits, within what the workload
    could have reused."""
    from benchmarks.runner import LoadSpec, run_level, workloads

    port, engine_key = cpu_engine
    spec = LoadSpec(base_url=f"http://127.0.0.1:{port}", model="tiny", api_key=engine_key, input_tokens=150, max_tokens=8,
                    min_requests=6, warmup_per_user=0, workers=1, tick_s=0.2,
                    workload={"kind": "multiturn", "turns": 3, "think_s": 0})
    level = run_level(spec, 2)
    assert level.completed == workloads.level_requests(spec, 2)[0], level.errors
    cache, reuse = level.server_metrics.get("prefix_cache"), level.prefix_reuse
    print("engine prefix cache:", cache, "workload could reuse:", reuse)
    assert cache and cache["queries"] == reuse["prompt_tokens"]  # the engine counted the prompts the runner sent
    assert 0 < cache["hits"] <= reuse["reusable_tokens"]


def test_keys_are_refused_and_a_revoked_key_is_refused_once_the_gateway_has_the_announced_change(process_env, spawn):
    """No clock: a key made after the revocation and announced with it (`canary`) is served only from a snapshot
    read after the revocation was committed, so once the canary passes, the very next request with the revoked key
    is refused. How long a revocation takes is perf/gateway_overhead.py's figure."""
    with SchedServer(ttft_ms=1, gap_ms=1, default_max_tokens=2) as sched:
        node = NodeFactory(name="gw-e2e-keys", address="127.0.0.1")
        make_deployment(node, sched.port, aliases=["kimi"])
        good, scoped = make_key(), make_key(model_names=["other"])
        expired = make_key(expires_at=timezone.now() - datetime.timedelta(seconds=1))
        gateway = start_gateway(spawn, process_env, node.name)
        chat = {"model": "kimi", "messages": [{"role": "user", "content": "hi"}]}
        url = gateway + "/v1/chat/completions"
        assert httpx.post(url, json=chat, headers=bearer(good)).status_code == 200
        assert httpx.post(url, json=chat, headers=bearer("vcp-wrong")).status_code == 401
        assert httpx.post(url, json=chat, headers=bearer(expired)).status_code == 401
        assert httpx.post(url, json=chat, headers=bearer(scoped)).status_code == 403

        def served(key):
            return lambda: httpx.post(url, json=chat, headers=bearer(key)).status_code == 200

        for _ in range(3):  # each a revocation after the last one the gateway saw
            victim = make_key()
            changes.changed("keys")
            wait_until(served(victim), timeout=30, message="the new key to be served")
            CallerKey.objects.filter(prefix=victim[:12]).update(revoked_at=timezone.now())
            canary = make_key()
            changes.changed("keys")  # what the revoke service does after its commit
            wait_until(served(canary), timeout=30, message="the gateway to serve the announced change")
            refused = httpx.post(url, json=chat, headers=bearer(victim))
            assert refused.status_code == 401 and "has been revoked" in refused.json()["error"]["message"]


def test_the_rps_limit_lets_through_its_rate_and_answers_429_with_retry_after(process_env, spawn):
    """Checked against what a token bucket allows whatever the machine's load (no timing compared): with `rate`
    tokens a second and one second's worth at the start, the gateway never admits more than the tokens there were,
    and a 429 means the bucket was empty, so at least the tokens that had come by then were admitted. Each
    request's send and answer times bound when the gateway decided."""
    rate, seconds = 20.0, 4.0
    with SchedServer(ttft_ms=1, gap_ms=1, default_max_tokens=1) as sched:
        node = NodeFactory(name="gw-e2e-rps", address="127.0.0.1")
        make_deployment(node, sched.port)
        key = make_key(rps_limit=rate)
        gateway = start_gateway(spawn, process_env, node.name)
        chat = {"model": "sched", "messages": [{"role": "user", "content": "hi"}]}

        async def hammer():
            ok, refused, end = [], [], time.monotonic() + seconds
            async with httpx.AsyncClient(base_url=gateway, headers=bearer(key), timeout=30) as client:
                async def worker():
                    while time.monotonic() < end:
                        sent = time.monotonic()
                        reply = await client.post("/v1/chat/completions", json=chat)
                        (ok if reply.status_code == 200 else refused).append((sent, time.monotonic(), reply))
                await asyncio.gather(*(worker() for _ in range(8)))
            return ok, refused

        ok, refused = run_async(hammer())
        assert refused and all(r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 for _, _, r in refused)
        # After the wait a 429 names, the key is let through again.
        time.sleep(int(refused[-1][2].headers["Retry-After"]))
        again = httpx.post(gateway + "/v1/chat/completions", headers=bearer(key), json=chat, timeout=30)
        assert again.status_code == 200, again.text
    first_sent = min(s for s, _, _ in ok + refused)  # the bucket is made, full, at the first decision: not before
    last = max(a for _, a, _ in ok)
    assert len(ok) <= rate + rate * (last - first_sent) + 1, f"{len(ok)} admitted in {last - first_sent:.2f} s"
    # Between two 429s the bucket went from empty to empty again, so the requests admitted meanwhile took at least
    # the tokens that came in between (the bucket cannot fill to its cap from empty in under 0.9 s at this rate).
    refused.sort(key=lambda r: r[0])
    checked = 0
    for i, (sent1, answered1, _) in enumerate(refused):
        later = [r for r in refused[i + 1:] if r[1] - sent1 < 0.9]
        if not later:
            continue
        sent2, answered2, _ = later[-1]
        came = rate * (sent2 - answered1)
        admitted = sum(1 for s, a, _ in ok if s < answered2 and a > sent1)
        assert admitted >= came - 1, f"{admitted} admitted while {came:.1f} tokens came ({sent2 - answered1:.2f} s)"
        checked += came > 5
    assert checked, "no two 429s far enough apart to check what came between them"
    print(f"rps limit {rate:g}: {len(ok)} admitted in {last - first_sent:.2f} s "
          f"({len(ok) / (last - first_sent):.1f}/s, a one-second burst included), {len(refused)} refused")


def test_an_alias_follows_a_swap_with_no_failed_request(process_env, spawn):
    """Streams to the alias keep going while deployment A stops and B becomes ready: the ones in flight on A end
    there, the ones arriving meanwhile wait in the gateway and complete on B."""
    with SchedServer(ttft_ms=20, gap_ms=5, default_max_tokens=20) as a, SchedServer(ttft_ms=20, gap_ms=5,
                                                                                     default_max_tokens=20) as b:
        node = NodeFactory(name="gw-e2e-swap", address="127.0.0.1")
        old = make_deployment(node, a.port, served="sched", aliases=["kimi"])
        new = make_deployment(node, b.port, served="sched", aliases=["kimi"], status=Deployment.Status.QUEUED)
        key = make_key()
        gateway = start_gateway(spawn, process_env, node.name, ready_wait=10)
        results, stop = [], threading.Event()

        def caller():
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    reply = client.post(gateway + "/v1/chat/completions", headers=bearer(key), json={
                        "model": "kimi", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
                    results.append((reply.status_code, reply.text.rstrip().endswith("[DONE]")))

        threads = [threading.Thread(target=caller) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        Deployment.objects.filter(pk=old.pk).update(status=Deployment.Status.STOPPING)  # the swap's plan stops A
        changes.changed("deployments")
        time.sleep(1.5)  # nothing ready: callers wait in the gateway
        waiting_on_a = a.server.requests_total
        Deployment.objects.filter(pk=new.pk).update(status=Deployment.Status.READY)
        changes.changed("deployments")
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(30)
        served_by_a_after = a.server.requests_total - waiting_on_a
    assert results and all(r == (200, True) for r in results), [r for r in results if r != (200, True)][:5]
    assert b.server.requests_total > 0 and served_by_a_after == 0
    print(f"{len(results)} streams, all complete; {b.server.requests_total} on the new deployment")
