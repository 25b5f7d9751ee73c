"""uvicorn's WebSocket protocol (websockets-sansio), with a stop that cannot hang on a peer that stopped reading.

A browser that no longer reads (frozen, its machine asleep, its driver killed) while the panel keeps sending fills
the server's send buffer: the consumer waits for the socket to drain, and the close frame of a stop can never be
flushed, so uvicorn waited its whole graceful-shutdown time, then cancelled the consumer and logged "ERROR: Cancel N
running task(s), timeout graceful shutdown exceeded". Such a socket is dropped a moment after the stop asked it to
close; one that drains closes as before. Run with `--ws plumbing.live.wsprotocol:WebSocketProtocol`.
"""
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

STOP_FLUSH_S = 1.0  # how long a stop waits for a socket's close to reach its peer before it drops the connection


class WebSocketProtocol(WebSocketsSansIOProtocol):
    def shutdown(self) -> None:
        super().shutdown()
        self.loop.call_later(STOP_FLUSH_S, self._drop)

    def _drop(self) -> None:
        if self in self.connections:  # not yet lost: its close is still waiting for the peer to read
            self.transport.abort()  # connection_lost follows: the consumer gets its disconnect, a blocked send ends
