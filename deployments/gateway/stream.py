"""Passing an engine's server-sent events through to the caller as they come, reading usage on the way.

Why not parse every event: at 256 streams of one token per event that is ~25,000 JSON documents a second on
the gateway's one core. The gateway asks the engine for `stream_options.include_usage` (vLLM then sends one
last event with `"choices": []` and the request's usage), so only events holding the bytes `"usage"` are
parsed; everything else is forwarded as read, cut only at event boundaries (so an event holding usage is
never half-forwarded before it is seen). When the caller did not ask for usage that last event is dropped.
"""
import json

from deployments.gateway.usage import Tokens, from_event

USAGE = b'"usage"'
END = b"\n\n"
MAX_CARRY = 1 << 20  # an "event" this long without a blank line is not SSE: forward it as it is


def scan(piece: bytes, strip: bool) -> tuple[bytes, Tokens | None]:
    """`piece` (whole events) with the usage-only event removed when `strip`, and the last usage in it."""
    tokens, kept, dropped = None, [], False
    for event in piece.split(END):
        if not event:
            continue
        if USAGE in event:
            obj = _data(event)
            found = from_event(obj)
            if found is not None:
                tokens = found
                if strip and obj.get("choices") == []:
                    dropped = True
                    continue
        kept.append(event)
    if not dropped:
        return piece, tokens
    return b"".join(e + END for e in kept), tokens


def _data(event: bytes):
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None


async def relay(chunks, write, strip: bool) -> Tokens | None:
    """Forward every piece `chunks` yields (an async iterator of bytes) through `write`; the last usage seen."""
    tokens, carry = None, b""
    async for piece in chunks:
        if carry:
            piece, carry = carry + piece, b""
        if not piece.endswith(END):  # the piece ends inside an event: keep its start for the next piece
            end = piece.rfind(END)
            piece, carry = (piece[:end + 2], piece[end + 2:]) if end >= 0 else (b"", piece)
            if len(carry) > MAX_CARRY:
                piece, carry = piece + carry, b""
            if not piece:
                continue
        if USAGE in piece:
            piece, found = scan(piece, strip)
            if found is not None:
                tokens = found
            if not piece:
                continue
        await write(piece)
    if carry:
        await write(carry)
    return tokens
