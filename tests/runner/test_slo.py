"""SLOs, goodput and the capacity search: what a level met, counted on records whose times are given,
and against the known-schedule server whose own record of each request's TTFT is the truth.

No test compares timings measured here: the server test's threshold sits a whole service time away
from every request's TTFT (a queue of one slot sends them a service time apart), and the search test's
measurements are a function of the rate.
"""
import json
import urllib.request

import pytest

from benchmarks.runner import LoadSpec, RequestRecord, sweep
from benchmarks.runner import capacity, slo
from benchmarks.runner.spec import LevelResult, RunnerError
from tests.schedserver import SchedServer


def record(ttft_s, gaps_s=(), success=True, tokens=None):
    times = [1.0 + ttft_s]
    for gap in gaps_s:
        times.append(times[-1] + gap)
    return RequestRecord(index=0, start=1.0, done=times[-1], chunk_times=times, success=success,
                         output_tokens=tokens or len(times), usage_seen=True)


def test_slos_read_from_text_in_seconds_or_milliseconds():
    assert slo.parse("ttft:p99:2s, itl:p95:50ms") == [{"metric": "ttft", "percentile": 99.0, "max_ms": 2000.0},
                                                      {"metric": "itl", "percentile": 95.0, "max_ms": 50.0}]
    assert slo.parse("e2e p90 1500") == [{"metric": "e2e", "percentile": 90.0, "max_ms": 1500.0}]
    assert slo.describe(slo.parse("ttft:p99:2s,itl:p95:50")) == "p99 TTFT <= 2 s and p95 ITL <= 50 ms"
    for bad in ("tpot:p99:2s", "ttft:p0:1s", "ttft:p99", "ttft:p101:5"):
        with pytest.raises(slo.SloError):
            slo.parse(bad)


def test_goodput_counts_requests_meeting_every_slo_and_failures_meet_none():
    records = [record(0.1, [0.01, 0.01]), record(0.1, [0.01, 0.2]), record(0.5, [0.01]), record(0.1, success=False)]
    slos = slo.parse("ttft:p50:200ms, itl:p100:50ms")
    got = slo.evaluate(records, slos, duration_s=2.0)
    # TTFT: the first two within 200 ms (the third took 500 ms, the failed one meets nothing); ITL at each
    # request's own p100: the second's 200 ms gap misses; so only the first meets both.
    assert got["good"] == 1 and got["goodput"] == 0.5 and got["attainment_pct"] == 25.0
    ttft, itl = got["each"]
    assert (ttft["met_pct"], ttft["holds"]) == (50.0, True)  # half the requests met it: p50 holds
    assert (itl["met_pct"], itl["holds"]) == (50.0, False) and got["met"] is False


def test_a_percentile_holds_exactly_at_its_share_of_requests():
    slos = [{"metric": "ttft", "percentile": 99, "max_ms": 100}]
    hundred = [record(0.05)] * 99 + [record(0.5)]
    assert slo.evaluate(hundred, slos, 1.0)["met"] is True  # 99 of 100 within: p99 holds
    assert slo.evaluate(hundred[1:] + [record(0.5)], slos, 1.0)["met"] is False  # 98 of 100
    assert slo.evaluate([], slos, 1.0)["met"] is False


def fake_measure(true_capacity):
    """A level that meets the SLOs exactly when its rate is at most the capacity (and the calls made)."""
    calls = []

    def measure(rate, repeat):
        calls.append((rate, repeat))
        return LevelResult(concurrency=0, kind="rate", rate=rate, repeat=repeat,
                           slo={"met": rate <= true_capacity, "goodput": min(rate, true_capacity), "attainment_pct": 100.0})
    return measure, calls


@pytest.mark.parametrize("truth", [3.3, 17.0, 63.9])
def test_the_search_lands_within_its_width_in_the_rounds_bisection_needs(truth):
    measure, calls = fake_measure(truth)
    slos = slo.parse("ttft:p99:2s")
    result = capacity.search(measure, slos, {"low": 1, "high": 65, "width": 1, "repeats": 2})
    assert len(result["rounds"]) == capacity.rounds_needed(1, 65, 1) == 6
    assert result["converged"] and result["high"] - result["low"] <= 1
    assert result["rate"] <= truth < result["high"] and truth - result["rate"] <= 1
    # A passing rate is measured twice; a miss once (a second repeat cannot make it pass).
    assert all(calls.count((rate, 1)) == (rate <= truth) for rate, _ in calls)
    assert f"serves {result['rate']:g} req/s at p99 TTFT <= 2 s" in result["text"]


def test_a_search_that_never_passes_says_the_limit_is_below_its_range():
    measure, _ = fake_measure(0.5)
    result = capacity.search(measure, slo.parse("e2e:p90:1s"), {"low": 1, "high": 9, "width": 1})
    assert result["rate"] is None and "less than 2 req/s" in result["text"]
    with pytest.raises(RunnerError, match="at most 12"):
        capacity.check({"low": 0.001, "high": 10_000, "width": 0.001})


def server_truth(server):
    with urllib.request.urlopen(server.base_url + "/stats?truth=1") as response:
        return json.load(response)["truth"]


def test_goodput_equals_the_servers_own_count_of_requests_meeting_the_slo():
    """One slot, a burst of 4 requests: the server serves them one after another, 2.01 s each (10 ms to the first
    token, then one gap of 2 s), so their TTFTs lie a service time apart. A TTFT the client measures is never below
    the server's own (the server cannot answer before it reads), so a request late for the server is late for the
    client; the first one meets the 1.5 s limit unless the client's own delay passes 1.49 s (a busy host once added
    250 ms: a limit 90 ms above the first TTFT flipped)."""
    with SchedServer(ttft_ms=10, gap_ms=2000, slots=1) as server:
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="builtin", ignore_eos=False, max_tokens=2,
                        levels=(), rates=(10_000.0,), min_requests=4, rate_duration_s=0.0001, workers=1, tick_s=0.1,
                        slos=slo.parse("ttft:p50:1500ms"), scrape_metrics=False, warmup_per_user=0)
        result = sweep(spec)
        truth = server_truth(server)
    level = result.levels[0]
    server_good = sum(ttft <= 1500 for ttft, *_ in truth)
    assert len(truth) == level.completed == 4 and server_good == 1
    assert level.slo["good"] == server_good
    assert level.slo["attainment_pct"] == pytest.approx(100 * server_good / 4, abs=0.001)
    assert level.slo["met"] is False  # p50 needs half of them


def test_a_capacity_sweep_reports_each_round_as_a_rate_level():
    with SchedServer(ttft_ms=5, gap_ms=5, slots=2) as server:
        spec = LoadSpec(base_url=server.base_url, model="sched", prompt_source="builtin", ignore_eos=False, max_tokens=2,
                        levels=(), min_requests=10, rate_duration_s=0.3, workers=1, tick_s=0.1, scrape_metrics=False,
                        slos=slo.parse("ttft:p90:5s"), capacity={"low": 10, "high": 90, "width": 20, "repeats": 1})
        seen = []
        result = sweep(spec, on_level=seen.append)
    rounds = result.capacity["rounds"]
    assert [r["rate"] for r in rounds] == [lv.rate for lv in seen] == [50.0, 70.0]  # a 5 s TTFT limit: every rate passes
    assert all(lv.kind == "rate" and lv.slo["met"] for lv in seen)
    assert result.capacity["rate"] == 70.0 and "at least 70 req/s" in result.capacity["text"]


def test_a_capacity_search_the_server_refuses_stops_at_its_first_round():
    with SchedServer(ttft_ms=5, gap_ms=5) as server:
        spec = LoadSpec(base_url=server.base_url + "/nowhere", model="sched", prompt_source="builtin", max_tokens=2,
                        levels=(), min_requests=4, rate_duration_s=0.1, workers=1, tick_s=0.1, scrape_metrics=False,
                        slos=slo.parse("ttft:p90:5s"), capacity={"low": 1, "high": 9, "width": 1})
        seen = []
        with pytest.raises(RunnerError, match="every request at 5 req/s failed: HTTP 404") as raised:
            sweep(spec, on_level=seen.append)
    assert raised.value.permanent and len(seen) == 1  # one round, kept; no more sent to a server that refuses them
