"""The network pre-flight of a multi-node deployment: before any engine starts, the head
listens on its master port and each worker node opens a TCP connection to it. A worker that cannot
reach the head fails here, in seconds, instead of vLLM hanging in its rendezvous. The pre-flight step also
asks each node whether it can firewall the deployment (host/firewall.check). Plain Python, no Django.
"""
from __future__ import annotations

import socket
import threading
import time

from deployments.host.errors import HostError


class PreflightError(HostError):
    """The head's port cannot be opened, or a worker cannot reach it."""


class Listener:
    """Accept (and close at once) connections on `port` until closed; a context manager."""

    def __init__(self, port: int, host: str = "127.0.0.1"):  # the head passes its cluster address: never all interfaces
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise PreflightError(f"cannot listen on port {port}: {exc.strerror or exc}", permanent=True) from exc
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.accepted = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"preflight-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        self.sock.close()  # the port is free again for the engine's TCPStore

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def reach(host: str, port: int, timeout_s: float = 5.0) -> float:
    """Open a TCP connection to (host, port); the seconds it took, or PreflightError saying why not."""
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return time.monotonic() - started
    except (TimeoutError, socket.timeout) as exc:
        raise PreflightError(f"no answer from {host}:{port} within {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise PreflightError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
