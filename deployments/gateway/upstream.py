"""Streams from an engine, read with llhttp (httptools, as uvicorn does) and written straight into the caller's
socket from the engine socket's own callback.

Why not aiohttp's client here: its reader wakes a coroutine per HTTP chunk (a future, a StreamReader buffer,
flow-control calls) and its writer awaits a drain per write: ~30 µs of Python per event, which at 256 streams of a
token every 10 ms is more than the gateway's core. Here an event costs one parse and one socket write, with no
task switch. Flow control: when the caller's socket buffer passes HIGH, the engine socket stops being read until
it drains (the engine then sees TCP back-pressure, as it would from a slow direct caller).
"""
import asyncio
import socket

import httptools

from deployments.gateway.stream import END, Relay

HIGH = 1 << 20
# Idle engine connections kept per engine: as many as the largest default in-flight bound. Streams started
# together end in the same engine step, so a whole batch's connections come back at once. With 64 kept, up to
# 192 of 256 were closed and opened again each round, work for the engine's API server on its busy core: the
# CPU engine's c=256 throughput through the gateway was 0.83x direct, 0.98x with all kept. The engine closes
# the ones idle past its keep-alive (connect() skips those).
KEEP_IDLE = 1024


class Broken(Exception):
    """The engine's connection failed or closed before its answer ended."""


class Sink:
    """Where one answer goes: its head (status, headers) to the handler, its body to the caller's transport once
    the handler has sent the head (`attach`), else into `held` (an answer that is not a stream, and a stream's first
    event, which the handler reads before it answers)."""

    def __init__(self, loop, strip: bool, framed: bool = True):
        self.head = loop.create_future()  # (status, {header: value})
        self.first = loop.create_future()  # None once the first whole event (or the answer's end) is held
        self.done = loop.create_future()  # None, or an exception
        self.relay = Relay(strip)
        self.framed = framed  # HTTP/1.1 chunks to the caller (an HTTP/1.0 caller reads to the connection's end)
        self.out = None
        self.held: list[bytes] = []
        self.conn = None

    def attach(self, transport) -> None:
        """Write the body to `transport` (HTTP/1.1 chunked) from now on, the part held so far first."""
        self.out = transport
        held, self.held = self.held, []
        for piece in held:
            self.body(piece)

    def body(self, data: bytes) -> None:
        out = self.out
        if out is None:
            if not self.first.done() and END in (self.held[-1][-1:] if self.held else b"") + data:
                self.first.set_result(None)  # END is 2 bytes: it can only begin in the last byte held before
            self.held.append(data)
            return
        piece = self.relay.feed(data)
        if piece:
            if out.is_closing():
                self.finish(Broken("the caller went away"))
                return
            out.write(b"%x\r\n%s\r\n" % (len(piece), piece) if self.framed else piece)
            if out.get_write_buffer_size() > HIGH and self.conn is not None:
                self.conn.pause_until_drained(out)

    def finish(self, error: Exception | None = None) -> None:
        if not self.head.done():
            self.head.set_exception(error or Broken("no answer"))
        if not self.first.done():
            self.first.set_result(None)
        if not self.done.done():
            self.done.set_result(error)
        if error is not None and self.conn is not None:
            self.conn.abort()

    def rest(self) -> bytes:
        return self.relay.close()


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to an engine, reused for answer after answer while the engine keeps it alive."""

    def __init__(self, pool, address):
        self.pool, self.address = pool, address
        self.transport = None
        self.sink: Sink | None = None
        self.parser = None
        self.headers: dict = {}
        self.keep_alive = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, request: bytes, sink: Sink) -> None:
        self.sink, sink.conn = sink, self
        self.parser = httptools.HttpResponseParser(self)
        self.headers = {}
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(Broken(f"the engine's answer is not HTTP: {exc}"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if not self.sink.head.done():
            self.sink.head.set_result((self.parser.get_status_code(), self.headers))

    def on_body(self, body: bytes) -> None:
        self.sink.body(body)

    def on_message_complete(self) -> None:
        sink, self.sink, self.parser = self.sink, None, None
        if self.keep_alive and not self.transport.is_closing():
            self.pool.release(self)
        else:
            self.transport.close()
        sink.finish()

    def connection_lost(self, exc) -> None:
        self.pool.forget(self)
        if self.sink is not None:
            self._end(Broken(f"the engine closed the connection: {exc or 'end of stream'}"))

    def _end(self, error: Exception) -> None:
        sink, self.sink, self.parser = self.sink, None, None
        if self.transport is not None:
            self.transport.close()
        if sink is not None:
            sink.finish(error)

    def abort(self) -> None:
        """Stop reading this answer (the caller left): the engine sees the connection close and aborts it."""
        self.sink, self.parser = None, None
        if self.transport is not None:
            self.transport.abort()

    def pause_until_drained(self, out) -> None:
        self.transport.pause_reading()
        loop = asyncio.get_running_loop()

        def check():
            if out.is_closing():
                self.abort()
            elif out.get_write_buffer_size() > HIGH // 4:
                loop.call_later(0.005, check)
            elif not self.transport.is_closing():
                self.transport.resume_reading()

        loop.call_later(0.005, check)


class Pool:
    """Idle connections by (host, port)."""

    def __init__(self):
        self.idle: dict[tuple, list[Connection]] = {}

    async def connect(self, host: str, port: int, timeout: float = 10.0, tls=None) -> tuple[Connection, bool]:
        """A connection and whether it was idle here (the engine may have closed it meanwhile: ask again); `tls`:
        an SSL context for a peer gateway that serves TLS."""
        idle = self.idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(
            lambda: Connection(self, (host, port)), host, port, ssl=tls, server_hostname=host if tls else None), timeout)
        return conn, False

    def release(self, conn: Connection) -> None:
        idle = self.idle.setdefault(conn.address, [])
        if len(idle) < KEEP_IDLE:
            idle.append(conn)
        else:
            conn.transport.close()

    def forget(self, conn: Connection) -> None:
        idle = self.idle.get(conn.address)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        for idle in self.idle.values():
            for conn in idle:
                conn.transport.close()
        self.idle.clear()


def request_bytes(host: str, port: int, path: str, headers: dict, body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}",
             *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
