"""Reading vLLM's Prometheus /metrics: label sets, engines, and the generation rate."""
import pytest

from benchmarks.runner import parse_prometheus
from benchmarks.runner.scrape import sample, summarize

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
"""


def test_gauges_sum_over_engines_and_kv_cache_reads_the_fullest():
    reading = sample(parse_prometheus(TEXT))
    assert reading == {"num_requests_running": 5.0, "num_requests_waiting": 7.0,
                       "kv_cache_usage_perc": 0.5, "generation_tokens_total": 1000.0}


def test_old_gpu_cache_name_is_read_as_kv_cache_usage():
    assert sample(parse_prometheus("vllm:gpu_cache_usage_perc 0.75\n"))["kv_cache_usage_perc"] == 0.75


def test_level_summary_has_max_mean_and_generation_rate_from_the_counter():
    samples = [(0.0, {"num_requests_running": 2.0, "generation_tokens_total": 100.0}),
               (1.0, {"num_requests_running": 4.0, "generation_tokens_total": 400.0}),
               (2.0, {"num_requests_running": 0.0, "generation_tokens_total": 500.0})]
    summary = summarize(samples)
    assert summary["num_requests_running"] == {"max": 4.0, "mean": 2.0}
    assert summary["generation_tok_s"]["mean"] == pytest.approx(200.0)
    assert summary["generation_tok_s"]["max"] == pytest.approx(300.0)
    assert summary["samples"] == 3
