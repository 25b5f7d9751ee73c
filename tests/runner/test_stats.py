"""The metric math on hand-made records, checked against values worked out by hand."""
import pytest

from benchmarks.runner import RequestRecord, distribution, percentile, summarize


def record(index, start, times, tokens, kinds=None, **fields):
    kinds = bytearray(kinds or b"c" * len(times))
    return RequestRecord(index=index, start=start, done=times[-1] + 0.001, chunk_times=list(times),
                         chunk_kinds=kinds, output_tokens=tokens, usage_seen=True, success=True, **fields)


def test_percentiles_interpolate_between_ranks_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 95) == 7.0


def test_distribution_reports_population_std_and_milliseconds():
    stats = distribution([0.002, 0.004, 0.004, 0.004, 0.005, 0.005, 0.007, 0.009])
    assert stats["mean"] == pytest.approx(5.0)
    assert stats["std"] == pytest.approx(2.0)  # the textbook population example
    assert stats["median"] == pytest.approx(4.5)
    assert stats["p90"] == pytest.approx(7.6)  # rank 6.3 between 7 and 9


def test_empty_distribution_is_all_zeros_rather_than_an_error():
    assert distribution([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p95": 0.0, "p99": 0.0}


def test_ttft_tpot_e2e_and_itl_follow_vllm_bench_serve():
    level = summarize(1, [record(0, 10.0, [10.05, 10.06, 10.08], tokens=6)])
    assert level.ttft_ms["median"] == pytest.approx(50.0)
    assert level.e2e_ms["median"] == pytest.approx(80.0)
    assert level.tpot_ms["median"] == pytest.approx(30.0 / 5)  # (E2E - TTFT) / (tokens - 1)
    assert level.itl_ms["mean"] == pytest.approx(15.0)  # gaps of 10 and 20 ms, pooled
    assert level.itl_ms["median"] == pytest.approx(15.0)


def test_per_token_itl_spreads_each_gap_over_the_tokens_it_carried():
    exact = record(0, 0.0, [0.05, 0.06, 0.08], tokens=6, chunk_tokens=[1, 3, 2])
    level = summarize(1, [exact])
    # 10 ms over 3 tokens, then 20 ms over 2: five gaps of 3.33 and 10 ms.
    assert level.itl_per_token_ms["mean"] == pytest.approx((3 * 10 / 3 + 2 * 10) / 5)
    assert level.tokens_per_chunk == "usage"
    estimated = summarize(1, [record(0, 0.0, [0.05, 0.06, 0.08], tokens=6)])
    assert estimated.tokens_per_chunk == "estimated"  # 2 tokens per chunk assumed
    assert estimated.itl_per_token_ms["median"] == pytest.approx(7.5)  # 5, 5, 10, 10


def test_reasoning_split_prefers_usage_then_chunk_usage_then_chunk_counts():
    from_usage = summarize(1, [record(0, 0.0, [0.1, 0.2, 0.3], tokens=9, kinds=b"rcc", reasoning_tokens=4)])
    assert (from_usage.reasoning_tokens, from_usage.content_tokens, from_usage.reasoning_split) == (4, 5, "usage")
    from_chunks = summarize(1, [record(0, 0.0, [0.1, 0.2, 0.3], tokens=9, kinds=b"rcc")])
    assert (from_chunks.reasoning_tokens, from_chunks.content_tokens, from_chunks.reasoning_split) == (3, 6, "chunks")
    exact = summarize(1, [record(0, 0.0, [0.1, 0.2, 0.3], tokens=9, kinds=b"rcc", chunk_tokens=[5, 2, 2])])
    assert (exact.reasoning_tokens, exact.reasoning_split) == (5, "chunk_usage")


def test_a_zero_reasoning_count_contradicted_by_reasoning_chunks_is_not_believed():
    # vLLM 0.32 (deepseek_r1 parser) streams reasoning deltas yet reports reasoning_tokens 0.
    level = summarize(1, [record(0, 0.0, [0.1, 0.2], tokens=4, kinds=b"rr", reasoning_tokens=0)])
    assert (level.reasoning_tokens, level.content_tokens, level.reasoning_split) == (4, 0, "chunks")
    assert level.ttfc_ms == {}  # no content at all: no time to first content
    no_reasoning = summarize(1, [record(0, 0.0, [0.1, 0.2], tokens=4, kinds=b"cc", reasoning_tokens=0)])
    assert (no_reasoning.reasoning_tokens, no_reasoning.reasoning_split) == (0, "usage")


def test_time_to_first_content_skips_reasoning_chunks():
    level = summarize(1, [record(0, 0.0, [0.05, 0.06, 0.07], tokens=3, kinds=b"rrc")])
    assert level.ttft_ms["median"] == pytest.approx(50.0)
    assert level.ttfc_ms["median"] == pytest.approx(70.0)


def test_failed_requests_count_but_stay_out_of_latencies():
    ok = record(0, 0.0, [0.05, 0.06], tokens=2)
    failed = RequestRecord(index=1, start=0.0, done=0.5, error="HTTP 500: boom")
    level = summarize(2, [ok, failed])
    assert (level.num_requests, level.completed, level.failed_requests) == (2, 1, 1)
    assert level.ttft_ms["median"] == pytest.approx(50.0)
    assert level.errors == ["HTTP 500: boom"]
    assert level.duration_s == pytest.approx(0.5)  # first send to last completion, failures included


def test_throughputs_are_counts_over_first_send_to_last_completion():
    a = record(0, 1.0, [1.1, 1.15, 1.2], tokens=10, prompt_tokens=5)
    b = record(1, 1.5, [1.6, 1.7, 1.9], tokens=30, prompt_tokens=5)
    level = summarize(2, [a, b])
    assert level.duration_s == pytest.approx(0.901)
    assert level.output_throughput == pytest.approx(40 / 0.901)
    assert level.total_token_throughput == pytest.approx(50 / 0.901)
    assert level.request_throughput == pytest.approx(2 / 0.901)
    # Decode tokens over decode time, pooled: (9 + 29) / (0.1 + 0.3), not the mean of 90 and 96.7.
    assert level.tok_s_per_user == pytest.approx(38 / 0.4)


def test_single_stream_decode_is_total_decode_tokens_over_total_decode_time():
    # A request whose chunks came in three reads (decode 10 ms) beside two slow ones: the mean of the
    # rates would read (12.7 + 2 × 1.27) / 3 = 5.1 k tok/s; the pooled rate agrees with TPOT instead.
    fast = record(0, 0.0, [0.05] * 64 + [0.055] * 32 + [0.06] * 32, tokens=128)
    slow = [record(i, 0.0, [0.05 + 0.001 * j for j in range(101)], tokens=101) for i in (1, 2)]
    level = summarize(1, [fast, *slow])
    assert level.tok_s_per_user == pytest.approx((127 + 100 + 100) / (0.01 + 0.1 + 0.1))
    tpots = sorted([0.01 / 127, 0.1 / 100, 0.1 / 100])
    assert level.tpot_ms["median"] == pytest.approx(tpots[1] * 1000)


def test_chunks_of_one_read_are_one_arrival_so_no_gap_that_brought_tokens_reads_zero():
    # Five one-token chunks in three reads (2 + 2 + 1 at 50, 60 and 80 ms), as vLLM's events come when
    # the client's host is busy: the per-chunk gaps 0, 10, 0, 20 ms would have a median of 0.
    level = summarize(1, [record(0, 0.0, [0.05, 0.05, 0.06, 0.06, 0.08], tokens=5, chunk_tokens=[1] * 5)])
    assert level.itl_ms["median"] == pytest.approx(15.0)  # gaps between reads: 10 and 20 ms
    assert level.itl_per_token_ms["mean"] == pytest.approx((5 + 5 + 20) / 3)  # 10 ms over 2 tokens, 20 over 1
    assert min(level.itl_per_token_ms.values()) > 0


def test_a_request_whose_tokens_after_its_first_came_in_one_read_is_left_out_of_the_decode_figures():
    """Seen: TPOT median 0.01 ms and 2,446 tok/s per user beside ITL per token 1.97 ms. A request whose 127 tokens
    after its first came in one read 1 ms later has no decode a client timed: TTFT and E2E count it, TPOT and the
    per-user rate do not; a two-token answer's one gap is its decode."""
    burst = record(0, 0.0, [0.05] + [0.051] * 127, tokens=128)
    steady = record(1, 0.0, [0.05 + 0.002 * j for j in range(101)], tokens=101)
    two = record(2, 0.0, [0.05, 0.07], tokens=2)
    level = summarize(1, [burst, steady, two])
    assert level.ttft_ms["median"] == pytest.approx(50.0) and len(level.e2e_ms) and level.completed == 3
    assert level.tpot_ms["mean"] == pytest.approx((2.0 + 20.0) / 2)  # steady's 2 ms and two's 20 ms: no 0.008 ms
    assert level.tok_s_per_user == pytest.approx((100 + 1) / (0.2 + 0.02))
    assert summarize(1, [burst]).tpot_ms == {} and summarize(1, [burst]).tok_s_per_user == 0.0


def test_a_request_whose_tokens_all_came_in_one_read_has_no_decode_figures():
    level = summarize(1, [record(0, 0.0, [0.05] * 8, tokens=8)])
    assert level.ttft_ms["median"] == pytest.approx(50.0)
    assert level.tpot_ms == level.itl_ms == level.itl_per_token_ms == {}  # unknown, not "0.00 ms"
    assert level.tok_s_per_user == 0.0


def test_to_dict_leaves_out_the_per_request_records():
    data = summarize(1, [record(0, 0.0, [0.05], tokens=1)]).to_dict()
    assert "records" not in data and data["ttft_ms"]["median"] == pytest.approx(50.0)


def test_ttft_as_vllm_bench_serve_counts_it_ends_at_the_role_chunk_when_one_came_first():
    with_role = record(0, 10.0, [10.05, 10.06], tokens=2, first_choice=10.02)
    without = record(1, 20.0, [20.04, 20.05], tokens=2)
    level = summarize(2, [with_role, without])
    assert level.ttft_ms["mean"] == pytest.approx(45.0)  # ours: 50 and 40 ms to the first token
    assert level.ttft_vllm_bench_ms["mean"] == pytest.approx(30.0)  # 20 ms to the role chunk, 40 ms
    assert "ttft_vllm_bench_ms" in level.to_dict()
