"""A real HTTP webhook receiver: records each POST (path, headers, body) and answers `answer`. The notification
tests and the end-to-end alerting test both send to it; `signed` checks the panel's HMAC signature."""
import hashlib
import hmac
import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.conftest import free_port


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


@dataclass
class Receiver:
    """An HTTP server that records each POST; `answer` is the status it replies with."""

    port: int
    answer: int = 200
    received: list = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append(Received(self.path, dict(self.headers), body))
                self.send_response(receiver.answer)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@contextmanager
def receiving():
    """A Receiver on a free loopback port, stopped afterwards."""
    receiver = Receiver(free_port())
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()


def signed(received: Received, key: str) -> bool:
    """Whether `received` carries the panel's valid signature for `key` (X-Panel-Signature over timestamp.body)."""
    expected = "sha256=" + hmac.new(key.encode(), received.headers["X-Panel-Timestamp"].encode() + b"." + received.body,
                                    hashlib.sha256).hexdigest()
    return hmac.compare_digest(received.headers.get("X-Panel-Signature", ""), expected)
