"""The one client of a running vLLM server (agent and benchmark runner): health, models, a smoke-test
chat, sleep mode, and readings of its Prometheus /metrics. Plain Python, no Django.
"""
from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from deployments.host import slo
from deployments.host.errors import HostError

# A reading's keys and the vLLM metric names they come from, newest name first.
GAUGES = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the name before vLLM 0.10
}
GENERATION_TOTAL = "vllm:generation_tokens_total"
# Counters kept as they are, summed over engines: the prefix cache's (V1's names, as vLLM 0.32 serves them).
COUNTERS = {"prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
            "prefix_cache_hits_total": "vllm:prefix_cache_hits_total"}
_WANTED = {name for names in GAUGES.values() for name in names} | {GENERATION_TOTAL, *COUNTERS.values()}
_PREFIXES = tuple(f"{prefix}{name.removesuffix('_total')}" for name in _WANTED for prefix in ("", "# HELP ", "# TYPE "))
# No proxy from the environment, like the benchmark load itself (the agent talks to 127.0.0.1, which
# HTTP_PROXY without NO_PROXY would send away); urllib because a reading every tick must be cheap
# (httpx builds an SSL context per call: ~40 ms of CPU) and quiet (httpx logs each request at INFO).
# No redirects either: a server that answers 3xx is not an OpenAI API, and following one could send
# the panel's request to an address nobody allowed (a metadata service, another local server).


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, "redirects are not followed", headers, fp)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
NOT_OPENAI = "the answer is not an OpenAI API answer (not shown)"


def openai_error(body: str) -> str | None:
    """The message of an OpenAI-shaped error ({"error": {"message"}} or vLLM's {"object": "error", "message"}),
    or None. Anything else a server says is never echoed: the URL may be anyone's (SSRF)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"][:300]
    if obj.get("object") == "error" and isinstance(obj.get("message"), str):
        return obj["message"][:300]
    return None


class VllmError(HostError):
    """The server did not answer as vLLM's OpenAI API should."""


@dataclass
class SmokeResult:
    """One chat completion: the reply, any reasoning, its latency and token counts."""

    reply: str
    reasoning: str
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None


# vLLM's own admission refusals (vllm/exceptions.py QueueOverflowError, MaxQueuedTokensError: HTTP 503 with
# --max-num-queued-reqs / --max-num-queued-tokens reached); the gateway answers them as 429 with Retry-After.
ADMISSION_REFUSALS = ("The engine is currently busy and cannot accept new requests",
                      "The engine has reached its prefill token backlog limit")


def refused_for_load(status: int, message: str) -> bool:
    """A server that said "too much now, try again": 429, or vLLM's admission 503."""
    return status == 429 or (status == 503 and any(m in message for m in ADMISSION_REFUSALS))


def refused_in_stream(event) -> bool:
    """A stream's event that is vLLM's admission refusal: vLLM checks its caps again as it adds a request, after a
    stream's 200 has gone, and a request refused then gets the 503's error as an event ({"error": {..., "code": 503}})."""
    error = event.get("error") if isinstance(event, dict) else None
    return isinstance(error, dict) and isinstance(error.get("code"), int) and refused_for_load(
        error["code"], str(error.get("message") or ""))


def auth_headers(key: str) -> dict[str, str]:
    """What vLLM's --api-key (VLLM_API_KEY) check wants: `Authorization: Bearer <key>`; nothing without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _request(method: str, url: str, timeout: float, body: dict | None = None, key: str = "") -> str:
    """The response body; VllmError on a refused connection, a timeout or an HTTP error status. `key`: the
    engine's key (every engine the panel starts has one), sent as a Bearer token."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **auth_headers(key)})
    try:
        with _OPENER.open(request, timeout=timeout) as resp:
            return resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        # 4xx is our request (wrong model name, bad params); 5xx may pass.
        said = openai_error(e.read(65536).decode("utf-8", "replace")) if e.fp else None
        raise VllmError(f"{method} {url} -> {e.code}: {said or NOT_OPENAI}", permanent=400 <= e.code < 500) from e
    except (TimeoutError, socket.timeout) as e:
        raise VllmError(f"{method} {url} timed out after {timeout} s") from e
    except (OSError, ValueError) as e:  # URLError is an OSError; ValueError: not a URL
        raise VllmError(f"{method} {url} failed: {e}") from e


def health(base_url: str, timeout: float = 2.0, key: str = "") -> bool:
    """True if GET {base_url}/health succeeds (vLLM answers 200 when up, 503 when its engine died)."""
    try:
        _request("GET", f"{base_url.rstrip('/')}/health", timeout, key=key)
        return True
    except VllmError:
        return False


def served_models(base_url: str, timeout: float = 10.0, key: str = "") -> list[str]:
    """Ids of the models the server serves (GET /v1/models)."""
    text = _request("GET", f"{base_url.rstrip('/')}/v1/models", timeout, key=key)
    try:
        return [m["id"] for m in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise VllmError(f"unexpected /v1/models: {NOT_OPENAI}", permanent=True) from e


def max_model_lengths(base_url: str, timeout: float = 10.0, key: str = "") -> dict[str, int]:
    """Each served model's max_model_len, as vLLM lists it in GET /v1/models (models without one left out)."""
    text = _request("GET", f"{base_url.rstrip('/')}/v1/models", timeout, key=key)
    try:
        return {m["id"]: m["max_model_len"] for m in json.loads(text)["data"] if isinstance(m.get("max_model_len"), int)}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise VllmError(f"unexpected /v1/models: {NOT_OPENAI}", permanent=True) from e


def smoke_test(base_url: str, model: str, question: str = "What is the capital of France?",
               timeout: float = 60.0, max_tokens: int = 64, key: str = "",
               temperature: float | None = None) -> SmokeResult:
    """Ask one non-streaming chat question and return what came back (`temperature` 0: the same answer each time)."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "stream": False}
    if temperature is not None:
        body["temperature"] = temperature
    started = time.monotonic()
    text = _request("POST", f"{base_url.rstrip('/')}/v1/chat/completions", timeout, body, key=key)
    latency = time.monotonic() - started
    try:
        data = json.loads(text)
        message = data["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise VllmError(f"unexpected chat completion: {NOT_OPENAI}", permanent=True) from e
    usage = data.get("usage") or {}
    details = usage.get("completion_tokens_details") or {}
    return SmokeResult(
        reply=message.get("content") or "",
        # vLLM 0.32+ says `reasoning`; older servers `reasoning_content`.
        reasoning=message.get("reasoning") or message.get("reasoning_content") or "",
        latency_s=round(latency, 4),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        reasoning_tokens=details.get("reasoning_tokens"),
    )


# vLLM serves /sleep, /wake_up and /is_sleeping only with VLLM_SERVER_DEV_MODE=1 (a 404 without), outside
# its --api-key check (that guards /v1/... only). Without --enable-sleep-mode it still answers 200 to /sleep and
# frees nothing (no memory is in its sleep pool): the flags the engine was started with are the only tell.
NO_SLEEP_ROUTES = "the engine has no sleep endpoints: it was not started with VLLM_SERVER_DEV_MODE=1"


def _sleep_mode(method: str, url: str, timeout: float, key: str) -> dict:
    """The JSON object a sleep-mode endpoint answered; VllmError (permanent) when the engine has no such route."""
    try:
        text = _request(method, url, timeout, key=key)
    except VllmError as e:
        if isinstance(e.__cause__, urllib.error.HTTPError) and e.__cause__.code == 404:
            raise VllmError(NO_SLEEP_ROUTES, permanent=True) from e
        raise
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise VllmError(f"unexpected answer from {method} {url}: {NOT_OPENAI}", permanent=True)
    return answer


def sleep(base_url: str, level: int, key: str = "", timeout: float = 300.0, mode: str = "abort") -> None:
    """Put the engine to sleep (POST /sleep?level=N): 1 moves the weights to host RAM and drops the KV cache,
    2 drops both, 0 only pauses scheduling. vLLM's default `mode` "abort" ends the requests in flight; "wait"
    lets them finish first, "keep" keeps them paused. Requests that come while it sleeps wait for the wake."""
    query = urllib.parse.urlencode({"level": level, "mode": mode})
    _sleep_mode("POST", f"{base_url.rstrip('/')}/sleep?{query}", timeout, key)


def wake_up(base_url: str, tags: tuple[str, ...] = (), key: str = "", timeout: float = 300.0) -> bool:
    """Wake the engine (POST /wake_up), all of it or only the given tags ("weights", "kv_cache"); True when it
    is fully awake and serving again. After a level 2 sleep the weights come back uninitialised: vLLM reloads
    them only on POST /collective_rpc {"method": "reload_weights"} (also a dev-mode route)."""
    query = urllib.parse.urlencode([("tags", tag) for tag in tags])
    answer = _sleep_mode("POST", f"{base_url.rstrip('/')}/wake_up" + (f"?{query}" if query else ""), timeout, key)
    return answer.get("status") == "awake"


def reload_weights(base_url: str, key: str = "", timeout: float = 900.0) -> None:
    """Read the weights again from the model's files (POST /collective_rpc {"method": "reload_weights"}), what a
    wake from level 2 needs before the KV cache wakes: vLLM's own snapshot restore does weights, reload, kv_cache."""
    try:
        _request("POST", f"{base_url.rstrip('/')}/collective_rpc", timeout, {"method": "reload_weights"}, key=key)
    except VllmError as e:
        if isinstance(e.__cause__, urllib.error.HTTPError) and e.__cause__.code == 404:
            raise VllmError(NO_SLEEP_ROUTES, permanent=True) from e
        raise


def is_sleeping(base_url: str, key: str = "", timeout: float = 10.0) -> bool:
    """Whether the engine sleeps at any level, level 0 (scheduling paused) included (GET /is_sleeping)."""
    answer = _sleep_mode("GET", f"{base_url.rstrip('/')}/is_sleeping", timeout, key)
    if not isinstance(answer.get("is_sleeping"), bool):
        raise VllmError(f"unexpected /is_sleeping answer: {NOT_OPENAI}", permanent=True)
    return answer["is_sleeping"]


def parse_metrics(text: str) -> dict[str, float]:
    """One reading of a /metrics text: requests running and waiting summed over engines (and label
    sets), KV-cache use of the fullest engine, and generation_tokens_total (a counter)."""
    # Only the lines of the wanted families go to the parser: a vLLM page holds hundreds of histogram
    # buckets, and parsing them all cost milliseconds per reading in a thread sharing the GIL with
    # the benchmark's measuring loop.
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(wanted):
            for s in family.samples:
                if s.name in _WANTED and not math.isnan(s.value):
                    values.setdefault(s.name, []).append(float(s.value))
    except ValueError as e:
        raise VllmError(f"unreadable /metrics: {e}", permanent=True) from e
    reading = {}
    for key, names in GAUGES.items():
        series = next((values[name] for name in names if name in values), None)
        if series:
            reading[key] = max(series) if key == "kv_cache_usage_perc" else sum(series)
    if GENERATION_TOTAL in values:
        reading["generation_tokens_total"] = sum(values[GENERATION_TOTAL])
    for key, name in COUNTERS.items():
        if name in values:
            reading[key] = sum(values[name])
    return reading


def read_metrics(url: str, timeout: float = 2.0, key: str = "") -> dict[str, float]:
    """One reading (see parse_metrics) of the /metrics page at `url`."""
    return parse_metrics(_request("GET", url, timeout, key=key))


_SLO_PREFIXES = tuple(f"{prefix}{name.removesuffix('_total')}" for name in (slo.TTFT, slo.FINISHED, slo.ADMISSION)
                      for prefix in ("", "# HELP ", "# TYPE "))


def parse_slo_counters(text: str) -> slo.Counters:
    """The TTFT histogram and finished-request counters of a /metrics text (host/slo.py turns them into figures)."""
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_SLO_PREFIXES))
    try:
        return slo.counters(text_string_to_metric_families(wanted))
    except ValueError as e:
        raise VllmError(f"unreadable /metrics: {e}", permanent=True) from e


def read_engine(url: str, timeout: float = 2.0, key: str = "") -> tuple[dict[str, float], slo.Counters]:
    """One reading for the agent's watch: the gauges and token counter (parse_metrics) and the SLO counters."""
    text = _request("GET", url, timeout, key=key)
    return parse_metrics(text), parse_slo_counters(text)


def metrics_url(base_url: str) -> str:
    """Where a vLLM server at `base_url` serves its Prometheus metrics."""
    return f"{base_url.rstrip('/')}/metrics"


def tok_s(earlier: tuple[float, dict], later: tuple[float, dict]) -> float | None:
    """Generated tokens per second between two (time, reading) pairs, from the counter's rise; None
    when either lacks the counter or no time passed. A counter that fell (the engine restarted) gives 0."""
    (t1, r1), (t2, r2) = earlier, later
    if t2 <= t1 or "generation_tokens_total" not in r1 or "generation_tokens_total" not in r2:
        return None
    return max(0.0, (r2["generation_tokens_total"] - r1["generation_tokens_total"]) / (t2 - t1))


def tokenize(base_url: str, model: str, *, prompt: str | None = None, messages: list | None = None,
             add_special_tokens: bool | None = None, timeout: float = 10.0, key: str = "") -> list[int]:
    """Token ids the server's tokenizer gives a prompt (POST /tokenize, a vLLM extra): a `prompt` as
    /v1/completions would see it, or `messages` rendered through the chat template with the generation
    prompt, as /v1/chat/completions would. VllmError (permanent) when the server has no /tokenize."""
    body: dict = {"model": model}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt or ""
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    text = _request("POST", f"{base_url.rstrip('/')}/tokenize", timeout, body, key=key)
    try:
        tokens = json.loads(text)["tokens"]
        return [int(t) for t in tokens]
    except (ValueError, KeyError, TypeError) as e:
        raise VllmError(f"unexpected /tokenize answer: {NOT_OPENAI}", permanent=True) from e
