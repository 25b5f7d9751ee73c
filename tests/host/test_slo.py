"""deployments/host/slo.py: the TTFT quantile as Prometheus' histogram_quantile computes it, the error share
by finished reason, and a trailing window that starts again when the engine restarts."""
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.host import slo, vllm

INF = math.inf
# vLLM 0.32's own layout: one series per engine and label set, le as text, +Inf last.
TEXT = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 6.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 8.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 3.1
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 7.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 1.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="tiny"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
"""


def test_counters_sum_engines_by_bound_and_by_reason():
    got = vllm.parse_slo_counters(TEXT)
    assert got.ttft_buckets == ((0.1, 2.0), (0.5, 7.0), (INF, 10.0))
    assert got.finished == {"stop": 7.0, "length": 1.0, "abort": 2.0}
    assert vllm.parse_slo_counters("vllm:num_requests_running 1\n") == slo.Counters()  # an engine without them


def test_the_quantile_interpolates_within_its_bucket_as_prometheus_does():
    buckets = ((0.1, 2.0), (0.5, 7.0), (INF, 10.0))
    # rank 0.5 * 10 = 5: in (0.1, 0.5], 3 of its 5 observations in: 0.1 + 0.4 * 3/5
    assert slo.quantile(0.5, buckets) == pytest.approx(0.34)
    assert slo.quantile(0.1, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert slo.quantile(0.95, buckets) == 0.5  # in +Inf: the highest finite bound
    assert slo.quantile(0.95, ((0.1, 0.0), (INF, 0.0))) is None  # no observation
    assert slo.quantile(0.95, ()) is None


def test_the_window_compares_its_newest_reading_with_its_oldest_and_forgets_older_ones():
    window = slo.Window(seconds=300)
    old = slo.Counters(((0.1, 100.0), (1.0, 100.0), (INF, 100.0)), {"stop": 100.0})
    window.add(0.0, old)
    assert window.figures() == slo.Figures(None, None, 0, 0.0)  # one reading: nothing to compare
    # 10 new requests in the next 100 s, all slow (first token after 0.1-1 s), 1 aborted
    window.add(100.0, slo.Counters(((0.1, 100.0), (1.0, 110.0), (INF, 110.0)), {"stop": 109.0, "abort": 1.0}))
    figures = window.figures()
    assert figures.ttft_p95_s == pytest.approx(0.1 + 0.9 * 9.5 / 10)
    assert figures.error_share == pytest.approx(0.1) and figures.requests == 10 and figures.span_s == 100.0
    # 400 s later only the readings of the last 300 s (and one at their start) count: the slow ones are gone,
    # the 30 since then all had their first token within 0.1 s
    window.add(400.0, slo.Counters(((0.1, 110.0), (1.0, 120.0), (INF, 120.0)), {"stop": 119.0, "abort": 1.0}))
    window.add(500.0, slo.Counters(((0.1, 130.0), (1.0, 140.0), (INF, 140.0)), {"stop": 139.0, "abort": 1.0}))
    assert [t for t, _ in window.readings] == [100.0, 400.0, 500.0]
    figures = window.figures()
    assert figures.requests == 30 and figures.error_share == 0.0
    assert figures.ttft_p95_s == pytest.approx(0.1 * 0.95)


def test_an_engine_restart_starts_the_window_again():
    window = slo.Window()
    window.add(0.0, slo.Counters(((INF, 50.0),), {"stop": 50.0}))
    window.add(10.0, slo.Counters(((INF, 60.0),), {"stop": 55.0, "abort": 5.0}))
    assert window.figures().error_share == pytest.approx(0.5)
    window.add(20.0, slo.Counters(((INF, 1.0),), {"stop": 1.0}))  # counters fell: a new process
    assert len(window.readings) == 1 and window.figures().requests == 0


def test_the_reader_gives_the_gauges_and_the_counters_of_one_page():
    families = list(text_string_to_metric_families(TEXT))
    gauges, counters = vllm.parse_metrics(TEXT), slo.counters(families)
    assert gauges == {"num_requests_running": 1.0} and counters.finished["abort"] == 2.0


def test_admission_refusals_are_counted_over_the_window_apart_from_the_finished():
    """vLLM 0.32's vllm:admission_rejections (by reason, --max-num-queued-reqs / -tokens): the window's refusals,
    not among its finished requests nor in the error share (which stays the alert rules' expression)."""
    page = TEXT + ('# HELP vllm:admission_rejections_total Number of admission attempts rejected by a queue limit, by '
                   'reason.\n# TYPE vllm:admission_rejections_total counter\n'
                   'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 4.0\n'
                   'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_tokens"} 1.0\n')
    first = vllm.parse_slo_counters(page)
    assert first.refused == 5.0
    window = slo.Window()
    window.add(0.0, first)
    later = slo.Counters(first.ttft_buckets, {**first.finished, "stop": first.finished["stop"] + 3}, refused=12.0)
    window.add(60.0, later)
    figures = window.figures()
    assert (figures.refused, figures.requests, figures.error_share) == (7, 3, 0.0)
    window.add(70.0, slo.Counters(later.ttft_buckets, later.finished, refused=2.0))  # fell: a new engine process
    assert len(window.readings) == 1 and window.figures().refused == 0
