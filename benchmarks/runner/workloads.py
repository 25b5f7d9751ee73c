"""Workloads beyond random prompts: what each request of a level sends, and how many of its prompt tokens
the engine's prefix cache could have served (no Django).

`spec.workload` is a dict with a "kind":
- "prefix": {"prefixes": K, "prefix_tokens": P}: request i starts with shared prefix i % K (P tokens),
  then a random suffix of spec.input_tokens tokens;
- "multiturn": {"turns": N, "think_s": T, "think": "fixed" | "exponential" | "uniform", "think_min_s",
  "think_max_s", "think_seed"}: conversations of N turns; turn t resends the whole history (t user messages
  of spec.input_tokens tokens and t assistant replies of spec.max_tokens tokens, the replies made up here so
  every request's bytes are known before the level starts), then a new user message; a user waits a think
  time after each answer before the next turn (load.run_share): T seconds, or a seeded draw (think_time);
- "sharegpt": {"entries": [...]}: prompt entries (workfiles.sharegpt), cycled like an uploaded JSONL;
- "trace": {"block_tokens": B, "requests": [[t_ms, input, output, [hash ids]], ...]}: a Mooncake trace;
  each hash id is a block of B tokens whose text is the same wherever the id appears, and a rate
  level replays the trace's own timing scaled to the level's rate (arrivals are the trace's, not drawn).

Texts are seeded by (spec.seed, the level's key, ...), so each level starts with a cold prefix cache and
its "could have reused" figure is its own.
"""
from __future__ import annotations

import math
import random

from .arrivals import rate_requests, rate_warmup
from .spec import CHAT
from .tokens import PromptLengths

KINDS = ("prefix", "multiturn", "sharegpt", "trace")
THINKS = ("fixed", "exponential", "uniform")  # how a multi-turn user's think time is drawn
GENERATED = ("prefix", "multiturn", "trace")  # kinds whose texts are made here, request by request


def kind(spec) -> str:
    return (spec.workload or {}).get("kind", "")


def _text(lengths, rng: random.Random, tokens: int) -> str:
    """Words the lengths count as `tokens` tokens, without the endpoint's overhead (a part of a prompt)."""
    lengths = lengths or PromptLengths()
    return lengths.prompt(rng, tokens + lengths.overhead)


def entry(spec, index: int, lengths, key) -> dict:
    """The prompt entry of request `index` of a level seeded by `key`."""
    w, seed = spec.workload, spec.seed
    if w["kind"] == "prefix":
        k = index % w["prefixes"]
        prefix = _text(lengths, random.Random(f"{seed}/{key}/prefix/{k}"), w["prefix_tokens"])
        suffix = _text(lengths, random.Random(f"{seed}/{key}/{index}"), spec.input_tokens)
        return {"prompt": f"{prefix} {suffix}"}
    if w["kind"] == "multiturn":
        conversation, turn = divmod(index, w["turns"])
        messages = []
        for t in range(turn + 1):
            rng = random.Random(f"{seed}/{key}/{conversation}/{t}")
            messages.append({"role": "user", "content": _text(lengths, rng, spec.input_tokens)})
            if t < turn:
                messages.append({"role": "assistant", "content": _text(lengths, rng, spec.max_tokens)})
        return {"messages": messages} if spec.endpoint == CHAT else {"prompt": "\n".join(m["content"] for m in messages)}
    if w["kind"] == "trace":
        t_ms, tokens, output, ids = _trace_request(w, index)
        sizes = _block_sizes(tokens, len(ids), w["block_tokens"])
        parts = [_text(lengths, random.Random(f"{seed}/{key}/h{hid}/{size}"), size) for hid, size in zip(ids, sizes)]
        return {"prompt": " ".join(parts), "max_tokens": output}
    raise ValueError(f"workload {w['kind']!r} has no generated entries")


def _block_sizes(tokens: int, blocks: int, block: int) -> list[int]:
    """Tokens of each block of a trace request: full blocks, the last one what is left."""
    full, rest = divmod(tokens, block)  # linear in the blocks (a running sum was quadratic: 12 s at 4e7 tokens)
    sizes = [block] * min(blocks, full)
    if len(sizes) < blocks and rest:
        sizes.append(rest)
    return sizes


def _trace_request(w: dict, index: int) -> tuple[float, int, int, list]:
    """Request `index` of a trace cycled as often as needed; each cycle's hash ids are new (a replayed day
    is new traffic, not the first day's prompts again)."""
    requests = w["requests"]
    cycle, i = divmod(index, len(requests))
    t_ms, tokens, output, ids = requests[i]
    if cycle:
        offset = cycle * (1 + max((h for r in requests for h in r[3]), default=0))
        ids = [h + offset for h in ids]
    return t_ms, tokens, output, ids


def _blocks(w: dict, index: int) -> list[tuple]:
    """A trace request's blocks as (hash id, tokens): one text each (a shorter last block is its own)."""
    if w.get("kind") != "trace":
        return []
    _, tokens, _, ids = _trace_request(w, index)
    return list(zip(ids, _block_sizes(tokens, len(ids), w["block_tokens"])))


def trace_rate(w: dict) -> float:
    """The trace's own request rate (requests/s): what a 1x replay sends."""
    times = [r[0] for r in w["requests"]]
    span = (times[-1] - times[0]) / 1000.0
    return (len(times) - 1) / span if span > 0 else 0.0


def trace_due(w: dict, rate: float, n: int) -> list[float]:
    """Seconds from the level's start at which each of n requests is due: the trace's own timestamps,
    time-scaled so the replay sends `rate` requests/s (rate = trace_rate is 1x), cycled when n is more
    than the trace holds (one mean gap between a cycle's last request and the next one's first)."""
    times = [r[0] / 1000.0 for r in w["requests"]]
    native = trace_rate(w) or rate
    scale = rate / native
    span = times[-1] - times[0]
    period = span + (span / (len(times) - 1) if len(times) > 1 else 1.0 / rate)
    out = []
    for index in range(n):
        cycle, i = divmod(index, len(times))
        out.append((times[i] - times[0] + cycle * period) / scale)
    return out


def think_time(w: dict, index: int) -> float:
    """Seconds a user thinks before sending request `index` (a later turn): think_s when fixed; else a draw
    seeded by (think_seed, index) alone, so the same workload thinks the same at every level and run:
    exponential of mean think_s, or uniform from think_min_s to think_max_s."""
    how = w.get("think", "fixed")
    if how == "fixed":
        return float(w.get("think_s", 0))
    rng = random.Random(f"{w.get('think_seed', 0)}/think/{index}")
    if how == "exponential":
        mean = float(w.get("think_s", 0))
        return rng.expovariate(1.0 / mean) if mean > 0 else 0.0
    return rng.uniform(float(w["think_min_s"]), float(w["think_max_s"]))


def think_summary(w: dict, sample: int = 2000) -> dict:
    """The think time a preview shows: how it is drawn, and the spread of its first `sample` draws (s)."""
    how = w.get("think", "fixed")
    out = {"think": how, **{k: w[k] for k in ("think_s", "think_min_s", "think_max_s", "think_seed") if k in w}}
    if how != "fixed":
        draws = sorted(think_time(w, i) for i in range(1, sample + 1))
        out["drawn_s"] = {"p10": round(draws[len(draws) // 10], 3), "p50": round(draws[len(draws) // 2], 3),
                          "p90": round(draws[len(draws) * 9 // 10], 3), "mean": round(sum(draws) / len(draws), 3)}
    return out


def rate_conversations(spec, rate: float) -> tuple[int, int]:
    """(conversations, warm-up conversations) of a multi-turn rate level, whose rate is of conversations
    (each starts at a scheduled arrival): max(min_requests ÷ turns, rate × rate_duration_s) measured ones,
    and arrivals.rate_warmup's count of warm-up ones before them."""
    turns = spec.workload["turns"]
    measured = max(math.ceil(spec.min_requests / turns), math.ceil(rate * spec.rate_duration_s))
    return measured, rate_warmup(spec, rate, measured)


def rate_level_requests(spec, rate: float) -> tuple[int, int]:
    """(measured requests, warm-up requests) a rate level sends; a multi-turn level's are whole conversations."""
    if kind(spec) == "multiturn":
        conversations, warmup = rate_conversations(spec, rate)
        return conversations * spec.workload["turns"], warmup * spec.workload["turns"]
    measured = rate_requests(spec, rate)
    return measured, rate_warmup(spec, rate, measured)


def level_requests(spec, concurrency: int) -> tuple[int, int]:
    """(requests, warmup requests) of a multi-turn concurrency level: whole conversations, at least one
    per user; warm-up conversations first (warmup_per_user each)."""
    turns = spec.workload["turns"]
    conversations = max(concurrency, math.ceil(spec.num_requests(concurrency) / turns))
    warmup = spec.num_warmup(concurrency)
    return (conversations + warmup) * turns, warmup * turns


def expected_prompt_tokens(spec, index: int) -> int:
    """Prompt tokens request `index` sends when every word is one token and the endpoint adds none (the
    project's known-schedule server counts so): what a test compares with the server's own count."""
    w = spec.workload
    if w["kind"] == "prefix":
        return w["prefix_tokens"] + spec.input_tokens
    if w["kind"] == "multiturn":
        turn = index % w["turns"]
        return (turn + 1) * spec.input_tokens + turn * spec.max_tokens
    if w["kind"] == "trace":
        return _trace_request(w, index)[1]
    raise ValueError(f"workload {w['kind']!r}: lengths come from its file")


def reuse(spec, records: list, warmup: int = 0) -> dict:
    """What the level's prompts could have taken from a prefix cache that forgets nothing: {"prompt_tokens"
    (the server's count), "reusable_tokens", "share"}; {} for prompts without a known structure.

    prefix: every request after the first use of its prefix (warm-up included) could reuse the prefix;
    multiturn: turn t could reuse all of turn t - 1's prompt as the server counted it (the history is
    resent as it was; the reply the engine generated is not, so its tokens are not counted);
    trace: the leading blocks whose hash ids an earlier request sent, whole blocks only."""
    w = spec.workload or {}
    if w.get("kind") not in GENERATED:
        return {}
    done = {r.index: r for r in records if r.success}
    prompt = reusable = 0
    seen: set = set()
    for index in range(min(done, default=0)):  # warm-up or earlier requests sent these blocks
        seen.update(_blocks(w, index))
    for index in sorted(done):
        record = done[index]
        prompt += record.prompt_tokens
        if w["kind"] == "prefix":
            reusable += w["prefix_tokens"] if index >= w["prefixes"] else 0
        elif w["kind"] == "multiturn":
            before = done.get(index - 1)
            if index % w["turns"] and before is not None:
                reusable += before.prompt_tokens
        else:
            blocks = _blocks(w, index)
            for block in blocks:
                if block not in seen:
                    break
                reusable += block[1]
            seen.update(blocks)
    return {"prompt_tokens": prompt, "reusable_tokens": reusable,
            "share": round(reusable / prompt, 4) if prompt else 0.0}


def length_problem(spec, max_model_len: int) -> str:
    """Why the workload's longest request cannot fit max_model_len ("" if it can, or without one)."""
    w = spec.workload or {}
    if w.get("kind") not in GENERATED:
        return ""
    if w["kind"] == "trace":
        longest = max(r[1] + r[2] for r in w["requests"])
        what = "the trace's longest request (input + output)"
    else:
        last = w["turns"] - 1 if w["kind"] == "multiturn" else 0
        longest = expected_prompt_tokens(spec, last) + spec.max_tokens
        what = "the last turn's history and answer" if w["kind"] == "multiturn" else "prefix + suffix + max_tokens"
    if longest > max_model_len:
        return f"{what} = {longest} tokens, more than the max model length {max_model_len}"
    return ""
