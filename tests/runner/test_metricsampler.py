"""A level's summary of vLLM /metrics readings (the readings themselves: tests/host/test_vllm.py)."""
import pytest

from benchmarks.runner.metricsampler import summarize


def test_level_summary_has_max_mean_and_generation_rate_from_the_counter():
    samples = [(0.0, {"num_requests_running": 2.0, "generation_tokens_total": 100.0}),
               (1.0, {"num_requests_running": 4.0, "generation_tokens_total": 400.0}),
               (2.0, {"num_requests_running": 0.0, "generation_tokens_total": 500.0})]
    summary = summarize(samples)
    assert summary["num_requests_running"] == {"max": 4.0, "mean": 2.0}
    assert summary["generation_tok_s"]["mean"] == pytest.approx(200.0)
    assert summary["generation_tok_s"]["max"] == pytest.approx(300.0)
    assert summary["samples"] == 3
