"""What of an engine's server-sent events goes to the caller, as they come, and the usage read on the way.

Why not parse every event: at 256 streams of one token per event that is ~25,000 JSON documents a second on
the gateway's one core. The gateway asks the engine for `stream_options.include_usage` (vLLM then sends one
last event with `"choices": []` and the request's usage), so only events holding the bytes `"usage"` are
parsed; everything else is forwarded as read, cut only at event boundaries (so an event holding usage is
never half-forwarded before it is seen). When the caller did not ask for usage that last event is dropped.
"""
import json

from deployments.gateway.usage import Tokens, from_event
from deployments.host import vllm

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


def refusal(first: bytes) -> dict | None:
    """The engine's admission refusal when a stream's first event is one (vllm.refused_in_stream), else None."""
    obj = _data(first.split(END, 1)[0])
    return obj if vllm.refused_in_stream(obj) else None


def _data(event: bytes):
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    try:
        return json.loads(b"\n".join(lines))
    except ValueError:
        return None


class Relay:
    """The bytes to forward for each piece an engine's stream is read in, and the last usage seen."""

    __slots__ = ("strip", "carry", "tokens", "events")

    def __init__(self, strip: bool):
        self.strip, self.carry, self.tokens = strip, b"", None
        self.events = 0  # events forwarded: what a stream cut before its usage event is counted by

    def feed(self, piece: bytes) -> bytes:
        if self.carry:
            piece, self.carry = self.carry + piece, b""
        if not piece.endswith(END):  # the piece ends inside an event: keep its start for the next piece
            end = piece.rfind(END)
            piece, self.carry = (piece[:end + 2], piece[end + 2:]) if end >= 0 else (b"", piece)
            if len(self.carry) > MAX_CARRY:
                piece, self.carry = piece + self.carry, b""
        self.events += piece.count(END)
        if USAGE in piece:
            piece, found = scan(piece, self.strip)
            if found is not None:
                self.tokens = found
        return piece

    def close(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event, forwarded as it is)."""
        rest, self.carry = self.carry, b""
        return rest
