"""Workload files read and checked (ShareGPT conversations, Mooncake traces) and a workload's preview
(no Django). A malformed file is refused with the line and the field that are wrong.
"""
from __future__ import annotations

import json
import math

import benchmarks.runner.workloads as workloads  # the module, not the package
from .spec import CHAT, PromptError
from .stats import percentile

MAX_ENTRIES = 100_000
TRACE_BLOCK_TOKENS = 512  # Mooncake's traces hash prompts in blocks of 512 tokens
# A request's lengths: at most the longest context any model serves (10M tokens, Llama 4 Scout). And a trace's
# blocks in all (one hash id each, kept in memory by the preview and every run): 1M blocks is 512M prompt tokens;
# an 80-byte line could otherwise ask for billions.
MAX_TRACE_TOKENS = 10 * 2**20
MAX_TRACE_BLOCKS = 1_000_000
CHARS_PER_TOKEN = 4  # a ShareGPT reply's length in tokens, estimated (its text is not sent)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


def _objects(text: str):
    """(line number, object) of a JSON array's elements or of JSONL lines, each with the line it starts on."""
    stripped = text.lstrip()
    if not stripped:
        raise PromptError("the file is empty")
    decoder = json.JSONDecoder()
    if stripped[0] != "[":
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except ValueError as exc:
                    raise PromptError(f"line {number}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        return
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            raise PromptError(f"line {text.count(chr(10), 0, pos) + 1}: the list is not closed with ]")
        if text[pos] == "]":
            return
        number = text.count("\n", 0, pos) + 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except ValueError as exc:
            raise PromptError(f"line {exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        yield number, obj


def _entries(text: str, what: str, fields: str):
    """("line N", object) of each entry, at most MAX_ENTRIES, each an object."""
    for count, (number, obj) in enumerate(_objects(text)):
        if count >= MAX_ENTRIES:
            raise PromptError(f"more than {MAX_ENTRIES} {what}; keep the file smaller")
        if not isinstance(obj, dict):
            raise PromptError(f"line {number}: expected an object with {fields}")
        yield f"line {number}", obj


def sharegpt(text: str, endpoint: str = CHAT) -> list[dict]:
    """Prompt entries from a ShareGPT file (a JSON list or JSONL of {"conversations": [{"from", "value"}]}):
    as vllm bench serve, each conversation's first turn is the prompt and the second turn's length (in
    tokens, estimated as characters / 4) its max_tokens; conversations of fewer than two turns are skipped."""
    entries = []
    for where, obj in _entries(text, "conversations", '"conversations"'):
        turns = obj.get("conversations", obj.get("conversation"))
        if not isinstance(turns, list):
            raise PromptError(f'{where}: field "conversations" must be a list of turns')
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
                raise PromptError(f'{where}: field "conversations[{i}].from" must be one of '
                                  f"{', '.join(sorted(SHAREGPT_ROLES))}")
            if not isinstance(turn.get("value"), str):
                raise PromptError(f'{where}: field "conversations[{i}].value" must be a string')
        if len(turns) < 2 or not turns[0]["value"].strip():
            continue
        output = max(1, math.ceil(len(turns[1]["value"]) / CHARS_PER_TOKEN))
        prompt = turns[0]["value"]
        entries.append({"messages": [{"role": "user", "content": prompt}], "max_tokens": output}
                       if endpoint == CHAT else {"prompt": prompt, "max_tokens": output})
    if not entries:
        raise PromptError("the file has no conversation of two turns or more")
    return entries


def mooncake(text: str) -> list[list]:
    """[[timestamp ms, input_length, output_length, [hash ids]], ...] from a Mooncake trace (JSONL of
    {"timestamp", "input_length", "output_length", "hash_ids"}), in the file's order, which must be
    time order."""
    out, previous, blocks = [], None, 0
    for where, obj in _entries(text, "requests", '"timestamp", "input_length", "output_length", "hash_ids"'):
        for name, least in (("timestamp", 0), ("input_length", 1), ("output_length", 1)):
            value = obj.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < least:
                raise PromptError(f'{where}: field "{name}" must be a number of at least {least}')
            if name != "timestamp" and value != int(value):
                raise PromptError(f'{where}: field "{name}" must be a whole number of tokens')
            if name != "timestamp" and value > MAX_TRACE_TOKENS:
                raise PromptError(f'{where}: field "{name}" is {int(value):,} tokens, more than any model takes '
                                  f"({MAX_TRACE_TOKENS:,})")
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids):
            raise PromptError(f'{where}: field "hash_ids" must be a list of whole numbers of at least 0')
        tokens = int(obj["input_length"])
        if previous is not None and obj["timestamp"] < previous:
            raise PromptError(f'{where}: field "timestamp" {obj["timestamp"]} is before the line before ({previous}); '
                              "a trace is in time order")
        previous = obj["timestamp"]
        blocks += max(len(ids), math.ceil(tokens / TRACE_BLOCK_TOKENS))
        if blocks > MAX_TRACE_BLOCKS:
            raise PromptError(f"{where}: the trace's prompts reach {MAX_TRACE_BLOCKS:,} blocks of "
                              f"{TRACE_BLOCK_TOKENS} tokens; keep it shorter")
        # A prompt longer than its hashed blocks keeps its own text for the rest (an id no other request has).
        out.append([float(obj["timestamp"]), tokens, int(obj["output_length"]), list(ids)])
    if not out:
        raise PromptError("the trace has no requests")
    if len(out) > 1 and out[-1][0] == out[0][0]:
        raise PromptError('every "timestamp" is the same: a trace needs times to replay')
    _own_tails(out)
    return out


def _own_tails(requests: list[list]) -> None:
    """Give each request the blocks its hash ids do not cover, with ids no other request uses."""
    top = max((h for r in requests for h in r[3]), default=-1) + 1
    for r in requests:
        missing = math.ceil(r[1] / TRACE_BLOCK_TOKENS) - len(r[3])
        if missing > 0:
            r[3] = r[3] + list(range(top, top + missing))
            top += missing


def _spread(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {}
    return {"count": len(values), "min": values[0], "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": values[-1], "mean": round(sum(values) / len(values), 2)}


def preview(spec, requests: int = 2000) -> dict:
    """What a workload sends, before anything runs: prompt and output lengths (tokens, one per word where
    made up here; ShareGPT prompts in words), the share a prefix cache could serve, and a trace's timing."""
    w = spec.workload
    out: dict = {"kind": w["kind"]}
    if w["kind"] == "sharegpt":
        entries = w["entries"]
        words = [len(" ".join(m["content"] for m in e["messages"]).split()) if "messages" in e else len(e["prompt"].split())
                 for e in entries]
        out.update(entries=len(entries), prompt_words=_spread(words), output_tokens=_spread([e["max_tokens"] for e in entries]))
        return out
    if w["kind"] == "trace":
        n = len(w["requests"])
        out.update(requests=n, rate=round(workloads.trace_rate(w), 4),
                   duration_s=round((w["requests"][-1][0] - w["requests"][0][0]) / 1000.0, 3))
        sample = n
    elif w["kind"] == "multiturn":
        sample = min(requests, 50 * w["turns"])
        out.update(turns=w["turns"], think_s=w.get("think_s", 0), think=workloads.think_summary(w))
    else:
        sample = min(requests, max(200, 4 * w["prefixes"]))
    records = [_Counted(i, workloads.expected_prompt_tokens(spec, i)) for i in range(sample)]
    outputs = [workloads._trace_request(w, i)[2] for i in range(sample)] if w["kind"] == "trace" else [spec.max_tokens]
    out.update(prompt_tokens=_spread([r.prompt_tokens for r in records]), output_tokens=_spread(outputs),
               prefix_reuse=workloads.reuse(spec, records))
    return out


class _Counted:
    """A request record as reuse() reads it: its index and the prompt tokens it would send."""

    success = True

    def __init__(self, index: int, prompt_tokens: int):
        self.index, self.prompt_tokens = index, prompt_tokens
