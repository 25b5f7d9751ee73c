"""Prompts (built-in, random, uploaded JSONL) and the HTTP request bytes built from them."""
from __future__ import annotations

import json
import random
from typing import NamedTuple
from urllib.parse import urlsplit

import benchmarks.runner.workloads as workloads  # the module, not the package
from .spec import CHAT, COMPLETIONS, LoadSpec, PromptError, RunnerError, request_timeout
from .tokens import WORDS, PromptLengths

MAX_JSONL_LINES = 100_000
ROLES = {"system", "user", "assistant", "tool", "developer"}

BUILTIN = [
    "Explain how a transformer model generates text, one token at a time.",
    "Write a short poem about a lighthouse keeper who collects lost letters.",
    "Summarize the causes and consequences of the French Revolution in five bullet points.",
    "What is the difference between a process and a thread? Give an example of each.",
    "Write a Python function that checks whether a string is a palindrome, with tests.",
    "Describe a plan for a three-day trip to Kyoto for someone who loves gardens and tea.",
    "Translate into French: The meeting has been moved to Thursday afternoon because of the storm.",
    "Explain the CAP theorem to a new backend engineer using a real-world analogy.",
    "List ten creative names for a coffee shop run by retired astronauts, with one-line pitches.",
    "A train leaves at 9:40 and arrives at 13:05. How long is the trip? Show your reasoning.",
    "Write a polite email declining a job offer while keeping the door open for the future.",
    "What are the trade-offs between SQL and NoSQL databases for an e-commerce catalogue?",
    "Tell a bedtime story about a dragon who is afraid of the dark.",
    "Explain gradient descent and why the learning rate matters, with a simple numeric example.",
    "Draft a README introduction for an open-source tool that benchmarks LLM inference servers.",
    "Compare the climates of Norway and New Zealand and how they shape daily life.",
]

def load_jsonl(text: str, endpoint: str = CHAT) -> list[dict]:
    """Validate uploaded JSONL: one {"prompt": str} or {"messages": [...]} object per line."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(entries) >= MAX_JSONL_LINES:
            raise PromptError(f"more than {MAX_JSONL_LINES} prompts; keep the file smaller")
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise PromptError(f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        entries.append(_entry(obj, number, endpoint))
    if not entries:
        raise PromptError("the file has no prompts")
    return entries


def _entry(obj, number: int, endpoint: str) -> dict:
    if not isinstance(obj, dict):
        raise PromptError(f'line {number}: expected an object like {{"prompt": "..."}} or {{"messages": [...]}}')
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise PromptError(f'line {number}: needs exactly one of "prompt" or "messages"')
    entry = {}
    if "max_tokens" in obj:
        if not isinstance(obj["max_tokens"], int) or isinstance(obj["max_tokens"], bool) or obj["max_tokens"] < 1:
            raise PromptError(f'line {number}: "max_tokens" must be a positive integer')
        entry["max_tokens"] = obj["max_tokens"]
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f'line {number}: "prompt" must be a non-empty string')
        entry["prompt"] = prompt
        return entry
    if endpoint == COMPLETIONS:
        raise PromptError(f'line {number}: "messages" need the chat endpoint; use "prompt" for {COMPLETIONS}')
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise PromptError(f'line {number}: "messages" must be a non-empty list')
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise PromptError(f"line {number}: message {i + 1} needs a role among {', '.join(sorted(ROLES))}")
        if not isinstance(message.get("content"), (str, list)):
            raise PromptError(f'line {number}: message {i + 1} needs "content" (a string or a list of parts)')
    entry["messages"] = messages
    return entry


def random_prompt(rng: random.Random, tokens: int, lengths: PromptLengths | None = None) -> str:
    """Random common words the endpoint counts as `tokens` tokens (one token per word without `lengths`)."""
    return (lengths or PromptLengths()).prompt(rng, tokens)


def _base(spec: LoadSpec) -> list[dict] | None:
    """The entries a non-random source cycles through; None for random prompts and made-up workloads."""
    if workloads.kind(spec) == "sharegpt":
        return spec.workload["entries"]
    if workloads.kind(spec) in workloads.GENERATED or spec.prompt_source == "random":
        return None
    if spec.prompt_source == "jsonl":
        if not spec.prompts:
            raise PromptError("prompt_source is jsonl but no prompts were loaded")
        return spec.prompts
    if spec.prompt_source == "builtin":
        return [{"prompt": p} for p in BUILTIN]
    raise PromptError(f"unknown prompt source {spec.prompt_source!r}")


def prompt_entries(spec: LoadSpec, count: int, lengths: PromptLengths | None = None, level: int = 0):
    """The first `count` entries of a level, one at a time (never all of them at once: a level may ask
    for 100,000 prompts of 200,000 tokens). Random prompts are drawn from a generator seeded by
    (seed, level, index): every request of every level distinct, which defeats prefix caching like
    vllm bench serve's random dataset, and any worker can make its own share without the others."""
    base = _base(spec)
    for index in range(count):
        yield _entry_at(spec, base, index, lengths, level)


def _entry_at(spec: LoadSpec, base: list[dict] | None, index: int, lengths, level: int) -> dict:
    if base is not None:
        return base[index % len(base)]
    if workloads.kind(spec) in workloads.GENERATED:
        return workloads.entry(spec, index, lengths, level)
    return {"prompt": random_prompt(random.Random(f"{spec.seed}/{level}/{index}"), spec.input_tokens, lengths)}


class Request(NamedTuple):
    """One request of a level as a worker sends it."""

    index: int
    warmup: bool
    data: bytes  # the whole HTTP request
    timeout_s: float  # how long it may take (spec.request_timeout: the spec's, or its own max_tokens')


def share_requests(spec: LoadSpec, target: Target, lengths: PromptLengths | None, level: int, total: int,
                   warmup: int, slots: list[int], key=None):
    """The Requests a worker owns, made as they are needed: request i belongs to the owner of slot i % level.
    Bytes of a cycled (built-in or uploaded) entry are made once. Random prompts are seeded by `key` (default:
    the level), so each level's prompts are its own."""
    base, cache, key = _base(spec), {}, level if key is None else key
    for index in _owned(spec, total, level, slots):
        entry = None if base is None else index % len(base)
        made = cache.get(entry)
        if made is None:
            body = request_body(spec, _entry_at(spec, base, index, lengths, key))
            made = target.request_bytes(body), request_timeout(spec, body.get("max_tokens") or spec.max_tokens)
            if entry is not None:
                cache[entry] = made
        yield Request(index, index < warmup, *made)


def _owned(spec: LoadSpec, total: int, level: int, slots: list[int]):
    """The indices a worker owns, in order: request i is slot i % level's; in a multi-turn level a whole
    conversation (turns consecutive indices) is slot conversation % level's, so one user sends it all."""
    turns = spec.workload["turns"] if workloads.kind(spec) == "multiturn" else 1
    for start in range(0, -(-total // turns), level):
        for slot in slots:
            first = (start + slot) * turns
            if first >= total:
                return
            yield from range(first, min(first + turns, total))


# Bytes per token of a random prompt: the words' mean length and a space (a word costs at least one token).
RANDOM_BYTES_PER_TOKEN = sum(len(w) + 1 for w in WORDS) / len(WORDS)


def prompt_bytes(spec: LoadSpec, count: int) -> int:
    """About how many prompt bytes `count` requests of the spec carry (random ones estimated from
    their length in tokens; built-in and uploaded ones counted as they cycle)."""
    base = _base(spec)
    if workloads.kind(spec) in workloads.GENERATED:
        tokens = sum(workloads.expected_prompt_tokens(spec, i) for i in range(count))
        return int(tokens * RANDOM_BYTES_PER_TOKEN)
    if base is None:
        return int(count * spec.input_tokens * RANDOM_BYTES_PER_TOKEN)
    sizes = [len(json.dumps(entry.get("messages") or entry.get("prompt", ""), separators=(",", ":"))) for entry in base]
    rounds, rest = divmod(count, len(sizes))
    return rounds * sum(sizes) + sum(sizes[:rest])


def request_body(spec: LoadSpec, entry: dict) -> dict:
    body = {"model": spec.model, "stream": True, "max_tokens": entry.get("max_tokens", spec.max_tokens),
            "temperature": spec.temperature, "stream_options": {"include_usage": True}}
    if spec.continuous_usage_stats:
        body["stream_options"]["continuous_usage_stats"] = True
    if spec.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extra parameter
    if spec.endpoint == CHAT:
        body["messages"] = entry.get("messages") or [{"role": "user", "content": entry["prompt"]}]
    else:
        body["prompt"] = entry["prompt"]
    body.update(spec.extra_body)
    return body


class Target:
    """Where requests go: host, port, TLS and the path, parsed once from the spec."""

    def __init__(self, spec: LoadSpec):
        if spec.endpoint not in (CHAT, COMPLETIONS):
            raise RunnerError(f"endpoint must be {CHAT} or {COMPLETIONS}, not {spec.endpoint!r}", permanent=True)
        url = urlsplit(spec.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise RunnerError(f"base_url must look like http://host:port, not {spec.base_url!r}", permanent=True)
        self.tls = url.scheme == "https"
        self.host = url.hostname
        self.port = url.port or (443 if self.tls else 80)
        prefix = url.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[:-3]
        self.prefix = prefix
        self.path = prefix + spec.endpoint
        default_port = (self.port == 443) if self.tls else (self.port == 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.api_key = spec.api_key

    @property
    def root_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host_header}{self.prefix}"

    def request_bytes(self, body: dict) -> bytes:
        """A complete HTTP/1.1 POST, built once and written in one call per request."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        head = [f"POST {self.path} HTTP/1.1", f"Host: {self.host_header}", "Content-Type: application/json",
                "Accept: text/event-stream", f"Content-Length: {len(payload)}", "User-Agent: panel-bench/1"]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + payload
