"""What the panel relies on from vLLM's OpenAI server, checked against the real CPU vLLM 0.32 and every double
(conftest.ENGINES): a double that answers otherwise than the real engine fails here. The expected values are the
real engine's, measured on it (docs/testing.md, "Conformance"). The last test kills the engine's core."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.gateway.server import FORWARDED
from deployments.host import slo, vllm
from tests.conformance.conftest import KEY, MAX_MODEL_LEN, SERVED, call

# Every /v1 route the panel and its gateway call (deployments/host/vllm.py, deployments/gateway/server.py), and
# one no server has: vLLM's key check guards the whole /v1 prefix, before any routing.
V1_ROUTES = sorted({("GET", "/v1/models"), *(("POST", path) for path in FORWARDED), ("GET", "/v1/no-such-route")})
UNAUTHORIZED = {"error": "Unauthorized"}  # vLLM's AuthenticationMiddleware, 401
PROMPT = [{"role": "user", "content": "Tell me a short story about a cat who lives in a small house by the sea."}]
# The /metrics samples the panel reads: the agent's gauges and token counters, the SLO counters.
PANEL_SAMPLES = {*(names[0] for names in vllm.GAUGES.values()), vllm.GENERATION_TOTAL, *vllm.COUNTERS.values(),
                 f"{slo.TTFT}_bucket", slo.FINISHED, "vllm:prompt_tokens_total", "vllm:engine_sleep_state"}


def _body(path: str) -> dict:
    if path.endswith("/chat/completions"):
        return {"model": SERVED, "messages": PROMPT, "max_tokens": 4}
    if path.endswith("/responses"):
        return {"model": SERVED, "input": "Tell me a short story about a cat by the sea.", "max_output_tokens": 4}
    return {"model": SERVED, "prompt": "Tell me a short story about a cat who lives by the sea.", "max_tokens": 4,
            "input": "a cat"}


@pytest.mark.parametrize("method,path", V1_ROUTES)
def test_every_v1_route_wants_the_engine_key(engine, method, path):
    body = None if method == "GET" else _body(path)
    for key in (None, "not-the-key", f"{KEY}x"):
        status, text, _ = call(engine, method, path, body, key=key)
        assert (status, json.loads(text)) == (401, UNAUTHORIZED), f"{method} {path} with key {key!r}"
    assert call(engine, method, path, body)[0] != 401


def test_health_answers_200_without_the_key(engine):
    assert call(engine, "GET", "/health", key=None)[:2] == (200, b"")


def test_models_lists_the_served_name_with_its_max_model_len(engine):
    status, text, _ = call(engine, "GET", "/v1/models")
    assert status == 200
    assert [(m["id"], m["object"], m["max_model_len"]) for m in json.loads(text)["data"]] == [
        (SERVED, "model", MAX_MODEL_LEN)]
    assert vllm.max_model_lengths(engine.base_url, key=KEY) == {SERVED: MAX_MODEL_LEN}


def test_metrics_serve_every_family_the_panel_reads_and_count_generated_tokens(engine):
    status, text, _ = call(engine, "GET", "/metrics", key=None)
    assert status == 200
    samples = {s.name: s for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert PANEL_SAMPLES <= set(samples), f"missing {sorted(PANEL_SAMPLES - set(samples))}"
    assert all(samples[name].labels.get("model_name") == SERVED for name in PANEL_SAMPLES)
    before = vllm.read_metrics(vllm.metrics_url(engine.base_url))
    assert set(before) >= {*vllm.GAUGES, "generation_tokens_total", *vllm.COUNTERS}
    status, text, _ = call(engine, "POST", "/v1/chat/completions",
                           {"model": SERVED, "messages": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 5
    deadline = time.monotonic() + 10  # the engine may record its stats just after answering
    while (after := vllm.read_metrics(vllm.metrics_url(engine.base_url)))["generation_tokens_total"] < \
            before["generation_tokens_total"] + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 5


def _events(text: bytes) -> list:
    lines = [line for line in text.decode().split("\n") if line.strip()]
    assert all(line.startswith("data: ") for line in lines)
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines]


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_streamed_chat_sends_a_role_chunk_the_tokens_and_usage_only_when_asked(engine, include_usage):
    body = {"model": SERVED, "messages": PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    status, text, headers = call(engine, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _events(text)
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = [e for e in events[:-1] if "usage" in e]
    tokens = [e for e in events[1:-1] if e["choices"]]
    assert len(tokens) == 6 and all(e["choices"][0]["delta"].get("content") for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 5 + ["length"]
    if include_usage:
        assert usage == [events[-2]] and events[-2]["choices"] == []
        counts = events[-2]["usage"]
        assert counts["completion_tokens"] == 6 and counts["total_tokens"] == counts["prompt_tokens"] + 6
    else:
        assert usage == []


def test_tokenize_counts_a_prompt_and_a_rendered_chat_without_the_key(engine):
    status, text, _ = call(engine, "POST", "/tokenize", {"model": SERVED, "prompt": "hello world"}, key=None)
    answer = json.loads(text)
    assert status == 200 and set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == MAX_MODEL_LEN
    chat = vllm.tokenize(engine.base_url, SERVED, messages=PROMPT)
    assert len(chat) > answer["count"] and all(isinstance(t, int) for t in chat)


def test_sleep_routes_in_dev_mode_answer_without_the_key(engine):
    """VLLM_SERVER_DEV_MODE=1 (conftest): the CPU build has the routes too, and without --enable-sleep-mode a
    sleep still answers and is reported."""
    assert json.loads(call(engine, "GET", "/is_sleeping", key=None)[1]) == {"is_sleeping": False}
    status, text, _ = call(engine, "POST", "/sleep?level=1", key=None)
    assert (status, json.loads(text)) == (200, {"status": "sleeping", "level": 1})
    assert json.loads(call(engine, "GET", "/is_sleeping", key=None)[1]) == {"is_sleeping": True}
    status, text, _ = call(engine, "POST", "/wake_up", key=None)
    assert (status, json.loads(text)) == (200, {"status": "awake", "tags": None})
    assert json.loads(call(engine, "GET", "/is_sleeping", key=None)[1]) == {"is_sleeping": False}


def test_an_unknown_flag_exits_2_with_argparses_message(engine, tmp_path):
    out = subprocess.run([*engine.cli, "serve", engine.model, "--no-such-flag"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=dict(os.environ, VLLM_API_KEY=KEY))
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == "vllm: error: unrecognized arguments: --no-such-flag"


def _core(engine) -> psutil.Process:
    """The engine core: vLLM's child titled VLLM::EngineCore, the title the doubles give their core child (in
    /proc/<pid>/comm, cut at 15 characters)."""
    children = psutil.Process(engine.proc.pid).children()
    cores = [c for c in children if c.name().startswith("VLLM::EngineCor")]
    assert len(cores) == 1, [(c.pid, c.name(), c.cmdline()[:3]) for c in children]
    return cores[0]


def test_when_the_engine_core_dies_health_turns_503_and_the_server_exits(engine):
    """Measured on the real one: 503 within ~0.1 s, the port closed ~1.2 s later, the API server gone by ~1.8 s."""
    core = _core(engine)
    os.kill(core.pid, signal.SIGKILL)
    seen, deadline = [], time.monotonic() + 30
    while engine.proc.poll() is None and time.monotonic() < deadline:
        try:
            status = call(engine, "GET", "/health", key=None, timeout=2)[0]
        except OSError:
            status = "refused"
        if not seen or seen[-1] != status:
            seen.append(status)
        time.sleep(0.02)
    assert engine.proc.poll() is not None, f"still serving 30 s after its core died: {seen}"
    assert seen[0] in (200, 503) and 503 in seen and set(seen) <= {200, 503, "refused"}, seen
    assert engine.proc.returncode == 0
