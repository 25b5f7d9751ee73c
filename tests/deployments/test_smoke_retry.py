"""The plan's smoke test asks again after a transient failure (a busy host's first answer) and gives up
at once on a 4xx; against a small HTTP server speaking the OpenAI chat route."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments.host import vllm
from deployments.node import plan


def _server(statuses: list[int]):
    """Answers /v1/chat/completions with the next status of `statuses` (200: a real-shaped completion)."""
    asked = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status = statuses[min(len(asked), len(statuses) - 1)]
            asked.append(status)
            body = (json.dumps({"choices": [{"message": {"content": "Paris."}}],
                                "usage": {"prompt_tokens": 9, "completion_tokens": 3}}) if status == 200
                    else json.dumps({"object": "error", "message": f"status {status}"})).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, asked


class _Row:
    name, served_model_name = "smoke", "tiny"


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(plan, "SMOKE_RETRY_S", 0.01)


def test_a_503_is_asked_again_and_the_answer_kept(fast):
    server, asked = _server([503, 503, 200])
    try:
        result = plan._ask_smoke(_Row(), f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert asked == [503, 503, 200] and result.completion_tokens == 3 and result.reply == "Paris."


def test_a_4xx_is_the_answer_at_once(fast):
    server, asked = _server([404, 200])
    try:
        with pytest.raises(vllm.VllmError, match="404"):
            plan._ask_smoke(_Row(), f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert asked == [404]


def test_transient_failures_stop_at_the_bound(fast, settings):
    settings.SMOKE_BOUND_S = 0.5
    server, asked = _server([503])
    try:
        with pytest.raises(vllm.VllmError, match="503"):
            plan._ask_smoke(_Row(), f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert len(asked) > 1 and set(asked) == {503}
