"""Unit tests of deployments.host.vllm against a small local server standing in for vLLM."""
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments.host import vllm

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 64.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7959e+09
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.0219
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 123.0
"""

CHAT = {"choices": [{"message": {"role": "assistant", "content": "Paris.",
                                 "reasoning_content": "France is in Europe."}}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
                  "completion_tokens_details": {"reasoning_tokens": 5}}}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        routes = {"/health": (200, ""), "/metrics": (200, METRICS),
                  "/v1/models": (200, {"data": [{"id": "tiny"}]})}
        self._send(*routes.get(self.path, (404, {"error": "not found"})))

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["model"] != "tiny":
            self._send(404, {"error": {"message": f"model {body['model']} does not exist"}})
        else:
            self._send(200, CHAT)


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_health_is_true_only_when_the_server_answers_200(api):
    assert vllm.health(api)
    server_gone = api.rsplit(":", 1)[0] + f":{_closed_port()}"
    assert not vllm.health(server_gone, timeout=1.0)


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_smoke_test_reads_reply_reasoning_and_token_counts(api):
    result = vllm.smoke_test(api, "tiny")
    assert (result.reply, result.reasoning) == ("Paris.", "France is in Europe.")
    assert (result.prompt_tokens, result.completion_tokens, result.reasoning_tokens) == (20, 9, 5)
    assert result.latency_s > 0
    assert vllm.served_models(api) == ["tiny"]


def test_smoke_test_of_an_unknown_model_is_a_permanent_error(api):
    with pytest.raises(vllm.VllmError) as err:
        vllm.smoke_test(api, "other")
    assert err.value.permanent and "does not exist" in err.value.message


def test_a_reading_sums_requests_over_engines_and_takes_the_fullest_kv_cache(api):
    assert vllm.read_metrics(vllm.metrics_url(api)) == {
        "num_requests_running": 3.0, "num_requests_waiting": 7.0, "kv_cache_usage_perc": 0.5,
        "generation_tokens_total": 64.0,
    }


def test_a_reading_of_an_old_vllm_takes_gpu_cache_usage_as_kv_cache_use():
    assert vllm.parse_metrics("vllm:gpu_cache_usage_perc 0.75\n") == {"kv_cache_usage_perc": 0.75}


def test_metrics_that_are_not_prometheus_text_are_a_permanent_error():
    with pytest.raises(vllm.VllmError) as err:
        vllm.parse_metrics("vllm:num_requests_running{engine=0 three\n")
    assert err.value.permanent


def test_a_missing_metrics_page_is_an_error_the_caller_can_skip(api):
    with pytest.raises(vllm.VllmError) as err:
        vllm.read_metrics(api + "/nope")
    assert "404" in err.value.message


def test_tok_s_is_the_counters_rise_per_second_and_never_negative():
    assert vllm.tok_s((1.0, {"generation_tokens_total": 100.0}), (3.0, {"generation_tokens_total": 400.0})) == 150.0
    # The engine restarted between the readings: its counter starts again from 0.
    assert vllm.tok_s((1.0, {"generation_tokens_total": 900.0}), (2.0, {"generation_tokens_total": 5.0})) == 0.0
    assert vllm.tok_s((1.0, {"generation_tokens_total": 1.0}), (1.0, {"generation_tokens_total": 2.0})) is None
    assert vllm.tok_s((1.0, {}), (2.0, {"generation_tokens_total": 2.0})) is None
