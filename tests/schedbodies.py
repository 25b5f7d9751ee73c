"""What tests/schedserver.py's responses say (its chunks' bytes); when they leave is schedserver's part.

Chat chunks as vLLM writes them (a role-only chunk, `reasoning` then `content` deltas, a usage chunk
and [DONE]), completions as text; framed for HTTP/1.1 chunked encoding once, so a write is one call.
"""
import itertools
import json
import time

_ids = itertools.count(1)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _frame(data: bytes) -> bytes:
    """HTTP/1.1 chunked framing; chunks go straight to the transport after the headers."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def count_prompt(body) -> int:
    """Prompt tokens as the server reports them: words of the text, or token ids."""
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


def build_chunks(model, chat, n, reasoning, prompt_tokens, include_usage, continuous, sch):
    """The role chunk, then every framed token chunk (usage and [DONE] joined to the last) and sizes."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids)}"
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}

    def chunk(size, r, last, done):
        if chat:
            delta = {}
            if r:
                delta[sch.reasoning_field] = "r " * r
            if size - r:
                delta["content"] = "w " * (size - r)
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "length" if last else None}
        else:
            choice = {"index": 0, "text": "w " * size, "logprobs": None, "finish_reason": "length" if last else None}
        obj = {**base, "choices": [choice]}
        if continuous:
            obj["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done + size,
                            "total_tokens": prompt_tokens + done + size}
        return _frame(_sse(obj))

    if chat:
        first = _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
    else:
        first = b": stream starts\n\n"  # completions have no role chunk; a comment keeps the shape
    k = max(1, sch.tokens_per_chunk)
    m = -(-n // k)
    if continuous:  # every chunk differs: build them one by one
        frames = [chunk(min(k, n - j * k), max(0, min(k, reasoning - j * k, n - j * k)), j == m - 1, j * k)
                  for j in range(m)]
    else:  # chunks repeat: reasoning-only, at most one mixed, content-only, then the last
        full_r = min(reasoning // k, m - 1)
        mixed = 1 if reasoning % k and reasoning // k < m - 1 else 0
        frames = [chunk(k, k, False, 0)] * full_r
        if mixed:
            frames.append(chunk(k, reasoning % k, False, 0))
        frames += [chunk(k, 0, False, 0)] * (m - 1 - full_r - mixed)
        last = n - (m - 1) * k
        frames.append(chunk(last, max(0, min(last, reasoning - (m - 1) * k)), True, (m - 1) * k))
    sizes = [k] * (m - 1) + [n - (m - 1) * k]
    closing = b""
    if include_usage:
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        closing += _frame(_sse({**base, "choices": [], "usage": usage}))
    frames[-1] += closing + _frame(b"data: [DONE]\n\n")
    if sch.role_with_first_token:
        frames[0] = _frame(first) + frames[0]
        first = b""
    return first, frames, sizes


def full_response(model, chat, n, reasoning, prompt_tokens):
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    if chat:
        message = {"role": "assistant", "content": "w " * (n - reasoning)}
        if reasoning:
            message["reasoning"] = "r " * reasoning
        choice = {"index": 0, "message": message, "finish_reason": "length"}
    else:
        choice = {"index": 0, "text": "w " * n, "finish_reason": "length"}
    return {"id": f"x-{next(_ids)}", "object": "chat.completion" if chat else "text_completion",
            "model": model, "choices": [choice], "usage": usage}
