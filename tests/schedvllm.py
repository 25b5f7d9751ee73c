"""vLLM's face of tests/schedserver.py when the fake vLLM (tests/faults/fakevllm/vllm) runs it as its HTTP side: the
--api-key (VLLM_API_KEY) check on every /v1 path, the served model's name and max_model_len, /tokenize, vLLM's other
/metrics families, the dev-mode sleep routes, and /health turning 503 when the fake's engine core died (SIGUSR1 from
the fake) before the server exits, as vLLM 0.32's does. Held to the real engine by tests/conformance."""
from __future__ import annotations

import json
import os
import signal

from aiohttp import web

from tests.faults.fakevllm import fakeproto

DEAD_EXIT_CODE = 0  # vLLM's API server exited 0 after its core died (tests/conformance)


class VllmFace:
    def __init__(self, name: str, max_model_len: int):
        self.name, self.max_model_len = name, max_model_len
        self.keys = fakeproto.api_keys([])  # VLLM_API_KEY: the fake hands its key over in the environment
        self.dev_mode = bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0") or 0))
        self.dead = False
        self.sleep_level: int | None = None

    def refused(self, request) -> web.Response | None:
        if fakeproto.authorized(request.path, request.headers.get("Authorization"), self.keys):
            return None
        return web.json_response(fakeproto.UNAUTHORIZED, status=401)

    def routes(self) -> dict:
        routes = {("POST", "/tokenize"): self.tokenize}
        if self.dev_mode:
            routes |= {("GET", "/is_sleeping"): self.is_sleeping, ("POST", "/sleep"): self.sleep,
                       ("POST", "/wake_up"): self.wake_up}
        return routes

    def model(self) -> dict:
        return fakeproto.models(self.name, self.name, self.max_model_len)["data"][0]

    async def tokenize(self, request):
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        return web.json_response(fakeproto.tokenize(body, self.max_model_len))

    async def is_sleeping(self, request):
        return web.json_response({"is_sleeping": self.sleep_level is not None})

    async def sleep(self, request):
        self.sleep_level = int(request.query.get("level", "1"))
        return web.json_response({"status": "sleeping", "level": self.sleep_level})

    async def wake_up(self, request):
        self.sleep_level = None
        return web.json_response({"status": "awake", "tags": request.query.getall("tags", None)})

    def metrics(self, label: str, finished: int) -> list[str]:
        """The families schedserver's own /metrics lacks, as vLLM names them (no time_to_first_token sum kept)."""
        level = self.sleep_level
        states = {"awake": level is None, "weights_offloaded": level == 1, "discard_all": level == 2}
        inner = label[1:-1]
        lines = ["# TYPE vllm:request_success_total counter",
                 f'vllm:request_success_total{{{inner},finished_reason="length"}} {float(finished)}',
                 "# TYPE vllm:time_to_first_token_seconds histogram",
                 *(f'vllm:time_to_first_token_seconds_bucket{{{inner},le="{le}"}} {float(finished)}'
                   for le in ("1.0", "+Inf")),
                 f"vllm:time_to_first_token_seconds_count{label} {float(finished)}",
                 "# TYPE vllm:engine_sleep_state gauge",
                 *(f'vllm:engine_sleep_state{{{inner},sleep_state="{state}"}} {float(on)}'
                   for state, on in states.items())]
        return lines

    def on_core_death(self, loop) -> None:
        """SIGUSR1: the core is gone. /health answers 503, then the server ends (fakeproto.DEAD_SERVE_S later)."""
        def died():
            self.dead = True
            loop.call_later(fakeproto.DEAD_SERVE_S, os._exit, DEAD_EXIT_CODE)

        loop.add_signal_handler(signal.SIGUSR1, died)


def prefix_counters(label: str) -> list[str]:
    """vLLM's prefix-cache counters at zero, for a schedule that does not count them."""
    return [f"# TYPE vllm:prefix_cache_{name}_total counter\nvllm:prefix_cache_{name}_total{label} 0.0"
            for name in ("queries", "hits")]

