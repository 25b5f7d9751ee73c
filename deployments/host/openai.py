"""Talk to a running vLLM server's OpenAI API: a smoke-test chat, served models, /metrics."""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import httpx

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:  # pragma: no cover - the small parser below stands in
    text_string_to_metric_families = None

# The vLLM metrics the panel shows; histograms come back as NAME_sum and NAME_count.
METRIC_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # the name before vLLM 0.10
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
)


class OpenAIError(Exception):
    """The server did not answer as an OpenAI API should; `permanent` means retrying cannot help."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.message = message
        self.permanent = permanent


@dataclass
class SmokeResult:
    """One chat completion: the reply, any reasoning, its latency and token counts."""

    reply: str
    reasoning: str
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None


def _request(method: str, url: str, timeout: float, **kwargs) -> httpx.Response:
    try:
        resp = httpx.request(method, url, timeout=timeout, **kwargs)
    except httpx.TimeoutException as e:
        raise OpenAIError(f"{method} {url} timed out after {timeout} s") from e
    except httpx.HTTPError as e:
        raise OpenAIError(f"{method} {url} failed: {e}") from e
    if resp.status_code >= 400:
        # 4xx is our request (wrong model name, bad params); 5xx may pass.
        raise OpenAIError(f"{method} {url} -> {resp.status_code}: {resp.text[:300]}",
                          permanent=400 <= resp.status_code < 500)
    return resp


def smoke_test(base_url: str, model: str, question: str = "What is the capital of France?",
               timeout: float = 60.0, max_tokens: int = 64) -> SmokeResult:
    """Ask one non-streaming chat question and return what came back."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "stream": False}
    started = time.monotonic()
    resp = _request("POST", f"{base_url.rstrip('/')}/v1/chat/completions", timeout, json=body)
    latency = time.monotonic() - started
    try:
        data = resp.json()
        message = data["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise OpenAIError(f"unexpected chat completion: {resp.text[:300]}", permanent=True) from e
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


def served_models(base_url: str, timeout: float = 10.0) -> list[str]:
    """Ids of the models the server serves (GET /v1/models)."""
    resp = _request("GET", f"{base_url.rstrip('/')}/v1/models", timeout)
    try:
        return [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise OpenAIError(f"unexpected /v1/models: {resp.text[:300]}", permanent=True) from e


def metrics(base_url: str, timeout: float = 5.0, names=METRIC_NAMES) -> dict[str, float]:
    """Scrape /metrics: each wanted counter/gauge, and NAME_sum/NAME_count of histograms, summed over labels."""
    text = _request("GET", f"{base_url.rstrip('/')}/metrics", timeout).text
    wanted = set(names)
    out: dict[str, float] = {}
    for sample, value in _samples(text):
        base = re.sub(r"_(sum|count|bucket|created)$", "", sample)
        if sample.endswith(("_bucket", "_created")) or not (sample in wanted or base in wanted):
            continue
        if not math.isnan(value):
            out[sample] = out.get(sample, 0.0) + value
    return out


def _samples(text: str):
    """(sample name, value) pairs of a Prometheus text exposition."""
    if text_string_to_metric_families is not None:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                yield s.name, float(s.value)
        return
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        # name{labels} value [timestamp]; label values may hold spaces, so split after the braces.
        head, _, rest = line.rpartition("}") if "}" in line else ("", "", line)
        name = head.split("{", 1)[0] if head else rest.split()[0]
        fields = rest.split()
        try:
            yield name, float(fields[0] if head else fields[1])
        except (IndexError, ValueError):
            continue
