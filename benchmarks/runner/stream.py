"""A lean HTTP/1.1 streaming client: each read is timestamped on arrival, SSE is parsed from raw bytes.

Why not aiohttp: at high concurrency the per-chunk cost of a general client (stream reader, line
iterator, json.loads of every chunk) saturates the event loop, and its timestamps then measure the
client's own queue. Here a chunk costs a few byte searches; only the usage chunk is parsed as JSON.
"""
import asyncio
import json
import re
import ssl
import time

from deployments.host import vllm

perf_counter = time.perf_counter

HEAD, SIZE, DATA, CRLF, TRAILER, LENGTH, UNTIL_CLOSE, DONE = range(8)
_MAX_ERROR_BODY = 64 * 1024
_CONTENT = b'"content":'
_REASONING = b'"reasoning":'
_REASONING_CONTENT = b'"reasoning_content":'
_TOOL_CALLS = b'"tool_calls":'
_TEXT = b'"text":'
_CONTENT_STRING = b'"content":"'  # vLLM (pydantic) writes no space after the colon
_COMPLETION_TOKENS = b'"completion_tokens":'
_COMPLETION_TOKENS_RE = re.compile(rb'"completion_tokens":\s*(\d+)')
_CHOICE = re.compile(rb'"choices":\s*\[\s*\{')  # a chunk with at least one choice
KIND_CONTENT, KIND_REASONING, KIND_TOOL = ord("c"), ord("r"), ord("t")


def _filled(payload: bytes, key: bytes) -> bool:
    """Whether `key` has a non-empty value; a quoted key can't occur inside a JSON string unescaped."""
    i = payload.find(key)
    if i < 0:
        return False
    i += len(key)
    while payload[i:i + 1] == b" ":
        i += 1
    head = payload[i:i + 2]
    return not (head == b'""' or head == b"[]" or head[:1] == b"n")


def classify(payload: bytes) -> int:
    """The kind of token a chunk carries (content, reasoning, tool call), or 0 for none."""
    if _filled(payload, _CONTENT) or _filled(payload, _TEXT):
        return KIND_CONTENT
    if _filled(payload, _REASONING) or _filled(payload, _REASONING_CONTENT):
        return KIND_REASONING
    if _filled(payload, _TOOL_CALLS):
        return KIND_TOOL
    return 0


class Counters:
    """Per-process running totals read by the tick reporter."""

    __slots__ = ("chunks", "completed", "failed", "in_flight", "tokens", "token_chunks")

    def __init__(self):
        self.chunks = self.completed = self.failed = self.in_flight = self.tokens = self.token_chunks = 0


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one streamed request at a time."""

    def __init__(self, counters: Counters):
        self.counters = counters
        self.transport = None
        self.record = None
        self.closed = False
        self.uses = 0
        self._on_done = None
        self._timer = None
        self._request = b""

    # -- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        t = perf_counter()  # before any parsing: this is when the bytes arrived
        if self.record is None:
            self.transport.abort()  # nothing was asked: the connection is no longer trustworthy
            return
        if self._state == SIZE and self._status == 200 and not self._buf and not self._sse:
            pos = self._fast(data, 0, t)
            if pos == len(data):
                return
            data = data[pos:] if pos else data
        self._feed(data, t)

    def connection_lost(self, exc):
        self.closed = True
        if self.record is not None:
            if self.uses > 1 and self._state == HEAD and not self._buf:
                # The server closed this idle keep-alive connection as we reused it (uvicorn
                # drops idle ones after 5 s): nothing was answered, so the request may go again.
                record, on_done = self.record, self._on_done
                self.record = self._on_done = None
                self._timer.cancel()
                return on_done(self, record, False, self._request)
            if self._state == UNTIL_CLOSE:
                self._finish(perf_counter(), reusable=False)
            else:
                self.fail(f"connection lost: {exc}" if exc else "connection closed by the server")

    # -- one request -------------------------------------------------------------------------

    def send(self, record, request: bytes, on_done, timeout_s: float):
        """Write `request` and fill `record` as the response streams.

        Then `on_done(conn, record, reusable, retry)`, where `retry` holds the request bytes when
        a reused connection was closed before any answer and the request should go again.
        """
        self.record, self._on_done, self._request = record, on_done, request
        self.uses += 1
        self._state, self._buf, self._sse, self._left = HEAD, b"", b"", 0
        self._status, self._keep_alive, self._error_body, self._cum_tokens = 0, True, [], 0
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._time_out, timeout_s)
        record.start = record.start or perf_counter()
        self.transport.write(request)

    def _time_out(self, timeout_s: float):
        if self.record is not None:
            self.record.timed_out = True
        self.fail(f"timed out after {timeout_s:g} s")

    def fail(self, message: str):
        """End the request in flight as failed and drop the connection."""
        record = self.record
        if record is None:
            return
        record.error = record.error or message
        self._state = DONE
        self._complete(perf_counter(), reusable=False)
        if self.transport is not None:
            self.transport.abort()

    def _complete(self, t: float, reusable: bool):
        record, on_done = self.record, self._on_done
        self.record = self._on_done = None
        if self._timer is not None:
            self._timer.cancel()
        record.done = t
        on_done(self, record, reusable and self._keep_alive and not self.closed, b"")

    def _finish(self, t: float, reusable: bool = True):
        record = self.record
        self._state = DONE
        if self._status != 200:
            body = b"".join(self._error_body).decode("utf-8", "replace")
            message = _error_message(body)
            record.error = f"HTTP {self._status}: {message}"
            record.rejected = vllm.refused_for_load(self._status, message)
        elif not record.chunk_times:
            record.error = record.error or "the stream carried no tokens"
        else:
            record.success = not record.error
            if not record.usage_seen:  # no usage chunk: the best count we have
                record.output_tokens = self._cum_tokens or len(record.chunk_times)
        self._complete(t, reusable)

    # -- parsing -----------------------------------------------------------------------------

    def _fast(self, buf: bytes, pos: int, t: float) -> int:
        """Whole HTTP chunks that each hold one whole "data: ..." event, parsed in place.

        Returns where it stopped: at a partial chunk, the last chunk, or an event split
        across chunks, which the general parser (_feed) takes from there.
        """
        record, n, found = self.record, len(buf), 0
        times, kinds = record.chunk_times, record.chunk_kinds
        while pos < n:
            i = buf.find(b"\r\n", pos)
            if i < 0 or i - pos > 8:
                break
            try:
                start = i + 2
                end = start + int(buf[pos:i], 16)
            except ValueError:
                break
            if end == start or end + 2 > n:
                break
            if not (buf[end - 1] == 10 and buf.find(b"\n", start, end) == end - 2
                    and buf.startswith(b"data: ", start)):
                break
            j = buf.find(_CONTENT_STRING, start, end)
            if j > 0 and buf[j + 11] != 34:
                kind = KIND_CONTENT
            else:
                kind = classify(buf[start:end])
            if kind:
                times.append(t)
                kinds.append(kind)
                found += 1
                if buf.find(_COMPLETION_TOKENS, start, end) >= 0:
                    self._chunk_usage(buf[start:end])
            else:
                self._payload(buf[start + 6:end - 2], t)
            pos = end + 2
        self.counters.chunks += found
        return pos

    def _feed(self, data: bytes, t: float):
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        while pos < end:
            state = self._state
            if state == DATA:
                stop = pos + self._left
                if stop <= end:
                    self._body(buf[pos:stop], t)
                    pos, self._state = stop, CRLF
                else:
                    self._body(buf[pos:], t)
                    self._left -= end - pos
                    pos = end
            elif state == CRLF:
                if end - pos < 2:
                    break
                pos += 2
                self._state = SIZE
            elif state == SIZE:
                if self._status == 200 and not self._sse:
                    pos = self._fast(buf, pos, t)
                    if pos >= end:
                        break
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                try:
                    size = int(buf[pos:i].split(b";", 1)[0], 16)
                except ValueError:
                    return self.fail("malformed chunked encoding")
                pos = i + 2
                if size:
                    self._left, self._state = size, DATA
                else:
                    self._state = TRAILER
            elif state == TRAILER:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    break
                if i == pos:
                    return self._finish(t)
                pos = i + 2
            elif state == HEAD:
                i = buf.find(b"\r\n\r\n", pos)
                if i < 0:
                    break
                if not self._head(buf[pos:i]):
                    return
                pos = i + 4
                if self._state == LENGTH and self._left == 0:
                    return self._finish(t)
            elif state == LENGTH:
                take = min(self._left, end - pos)
                self._body(buf[pos:pos + take], t)
                self._left -= take
                pos += take
                if self._left == 0:
                    return self._finish(t)
            elif state == UNTIL_CLOSE:
                self._body(buf[pos:], t)
                pos = end
            else:
                return
        self._buf = buf[pos:] if pos < end else b""

    def _head(self, head: bytes) -> bool:
        lines = head.lstrip(b"\r\n").split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            self.fail(f"not an HTTP/1.x response: {lines[0][:80]!r}")
            return False
        self._keep_alive = parts[0] != b"HTTP/1.0"
        chunked, length = False, None
        try:
            self._status = int(parts[1])
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"content-length":
                    length = int(value)
                elif name == b"connection":
                    self._keep_alive = b"close" not in value.lower()
        except ValueError:
            self.fail(f"malformed HTTP response head: {head[:200]!r}")
            return False
        if chunked:
            self._state = SIZE
        elif length is not None:
            self._state, self._left = LENGTH, length
        else:
            self._state, self._keep_alive = UNTIL_CLOSE, False
        return True

    def _body(self, piece: bytes, t: float):
        if self._status != 200:
            if sum(map(len, self._error_body)) < _MAX_ERROR_BODY:
                self._error_body.append(piece)
            return
        buf = self._sse + piece if self._sse else piece
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while True:
            j = buf.find(b"\n\n", start)
            if j < 0:
                break
            self._event(buf[start:j], t)
            start = j + 2
        self._sse = buf[start:]

    def _event(self, event: bytes, t: float):
        if event[:6] == b"data: " and b"\n" not in event:
            payload = event[6:]
        else:
            lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                return  # a comment, a keep-alive or an event without data
            payload = b"\n".join(line[1:] if line[:1] == b" " else line for line in lines)
        self._payload(payload, t)

    def _payload(self, payload: bytes, t: float):
        kind = classify(payload)
        record = self.record
        if kind:
            record.chunk_times.append(t)
            record.chunk_kinds.append(kind)
            self.counters.chunks += 1
            if _COMPLETION_TOKENS in payload:
                self._chunk_usage(payload)
        elif payload[:6] == b"[DONE]":
            return
        else:
            if record.first_choice is None and _CHOICE.search(payload):
                record.first_choice = t  # e.g. vLLM's role-only first chunk: vllm bench serve's TTFT ends here
            if _COMPLETION_TOKENS in payload or b'"error"' in payload:
                self._control(payload)

    def _chunk_usage(self, payload: bytes):
        """Usage inside a token chunk (continuous_usage_stats): the exact tokens of this chunk."""
        match = _COMPLETION_TOKENS_RE.search(payload)
        if match:
            record, cum = self.record, int(match[1])
            if record.chunk_tokens is None:
                record.chunk_tokens = []
            record.chunk_tokens.append(max(0, cum - self._cum_tokens))
            self._cum_tokens = cum

    def _control(self, payload: bytes):
        """The usage chunk (parsed fully, once per request) or an error event mid-stream."""
        try:
            obj = json.loads(payload)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if obj.get("error"):
            self.record.error = f"stream error: {_error_message(json.dumps(obj))}"
            self.record.rejected = vllm.refused_in_stream(obj)  # vLLM's admission can refuse inside a 200
        usage = obj.get("usage")
        if isinstance(usage, dict) and not obj.get("choices"):
            record = self.record
            record.usage_seen = True
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("completion_tokens_details") or {}
            if isinstance(details, dict) and details.get("reasoning_tokens") is not None:
                record.reasoning_tokens = int(details["reasoning_tokens"])
        # Usage on a chunk without text (vLLM sends `"reasoning": ""` for a token that ends inside a
        # UTF-8 character) is left alone: those tokens count with the next chunk that has text.


def _error_message(body: str) -> str:
    """The server's own words when it answered an OpenAI-style error; never the body of anything else."""
    return vllm.openai_error(body) or vllm.NOT_OPENAI


def tls_context(verify: bool) -> ssl.SSLContext:
    """One per pool: building a context loads the CA bundle, far too slow to do per connection."""
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


async def open_connection(host: str, port: int, context: ssl.SSLContext | None, counters: Counters,
                          timeout_s: float = 30.0) -> Connection:
    """A new connection; raises OSError (or asyncio.TimeoutError) when the server can't be reached."""
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(
        loop.create_connection(lambda: Connection(counters), host, port, ssl=context), timeout_s)
    return conn
