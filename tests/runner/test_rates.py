"""Open-loop (rate) levels against a server with a known schedule: the schedule the runner draws, and
what the server recorded of what arrived.

Nothing here compares timings: the due times are a seeded draw (fixed by the seed, so a bound on them
cannot flip), a send is never earlier than its due time (a relation the runner guarantees), and counts
and the server's own count of requests in flight are exact.
"""
import random
import statistics

import pytest

from benchmarks.runner import LoadSpec, due_offsets, rate_requests, run_rate, sweep
from benchmarks.runner.arrivals import rate_at
from tests.schedserver import SchedServer, Server


def spec_for(server, **overrides):
    fields = dict(base_url=server.base_url, model="sched", prompt_source="builtin", ignore_eos=False, max_tokens=4,
                  levels=(), min_requests=40, rate_duration_s=0.5, tick_s=0.1, workers=1, seed=7,
                  warmup_per_user=0)  # the warm-up has its own tests (test_rate_warmup.py)
    fields.update(overrides)
    return LoadSpec(**fields)


class PeakServer(Server):
    """The schedule server, also keeping the most requests it was streaming at once (its own count)."""

    peak = 0

    @property
    def running(self):
        return self._running

    @running.setter
    def running(self, value):
        self._running = value
        self.peak = max(self.peak, value)


@pytest.fixture(scope="module")
def server():
    with SchedServer(ttft_ms=5, gap_ms=2) as running:
        yield running


def gaps(offsets):
    return [b - a for a, b in zip(offsets, offsets[1:])]


def cv(values):
    return statistics.pstdev(values) / statistics.fmean(values)


def test_a_rate_level_sends_its_seeded_schedule_and_never_early(server):
    before = server.server.requests_total
    spec = spec_for(server, min_requests=60)
    level = run_rate(spec, 80.0)
    asked = rate_requests(spec, 80.0)
    assert asked == 60 and level.num_requests == asked and level.completed == asked
    assert server.server.requests_total - before == asked  # the server's own count
    assert (level.kind, level.rate, level.label) == ("rate", 80.0, "80 req/s")
    records = level.records
    assert [r.index for r in records] == list(range(asked))
    drawn = due_offsets(spec, 80.0, asked)
    assert [r.due - records[0].due for r in records] == pytest.approx(drawn, abs=1e-9)  # the seeded draw, exactly
    assert all(r.start >= r.due for r in records)  # never before its time
    assert level.lag_ms["max"] == pytest.approx(max(r.start - r.due for r in records) * 1000)
    starts = sorted(r.start for r in records)
    assert level.achieved_rate == pytest.approx((asked - 1) / (starts[-1] - starts[0]))
    assert level.slot_wait_ms["count"] == 0 and level.warmup_requests == 0


def test_the_seeded_schedule_keeps_the_asked_rate_within_sampling_error():
    spec = LoadSpec(base_url="http://x", model="m", seed=3)
    for rate in (2.0, 50.0, 1000.0):
        n = 4000
        offsets = due_offsets(spec, rate, n)
        assert offsets == due_offsets(spec, rate, n)  # reproducible
        drawn_rate = (n - 1) / offsets[-1]
        # The mean of n - 1 exponential gaps has a relative standard error of 1/sqrt(n - 1): within 4 of them.
        assert abs(drawn_rate / rate - 1) < 4 / (n - 1) ** 0.5, (rate, drawn_rate)
    other = due_offsets(LoadSpec(base_url="http://x", model="m", seed=4), 50.0, 100)
    assert other != due_offsets(spec, 50.0, 100)  # another seed, another schedule


def test_poisson_gaps_are_pythons_own_exponential_draw():
    spec = LoadSpec(base_url="http://x", model="m", seed=9)
    rng = random.Random("9/rate/25.0")
    expected, t = [], 0.0
    for _ in range(50):
        expected.append(t)
        t += rng.expovariate(25.0)
    assert due_offsets(spec, 25.0, 50) == pytest.approx(expected, rel=1e-12)


def test_burstiness_sets_the_coefficient_of_variation_of_the_gaps():
    n = 20_000
    for burstiness, expected_cv in ((0.25, 2.0), (1.0, 1.0), (4.0, 0.5)):
        spec = LoadSpec(base_url="http://x", model="m", arrival="gamma", burstiness=burstiness)
        drawn = gaps(due_offsets(spec, 100.0, n))
        # A gamma of shape k has CV 1/sqrt(k); the mean gap stays 1/rate whatever the burstiness.
        assert cv(drawn) == pytest.approx(expected_cv, rel=0.08), burstiness
        assert statistics.fmean(drawn) == pytest.approx(0.01, rel=0.05)
    poisson = LoadSpec(base_url="http://x", model="m", arrival="poisson", burstiness=0.25)
    assert cv(gaps(due_offsets(poisson, 100.0, n))) == pytest.approx(1.0, rel=0.05)  # Poisson ignores it


def test_a_ramp_moves_the_rate_from_its_start_to_the_level():
    for ramp in ("linear", "exponential"):
        spec = LoadSpec(base_url="http://x", model="m", ramp=ramp, ramp_from=10.0)
        assert rate_at(spec, 100.0, 0, 1001) == pytest.approx(10.0)
        assert rate_at(spec, 100.0, 1000, 1001) == pytest.approx(100.0)
        middle = rate_at(spec, 100.0, 500, 1001)
        assert middle == pytest.approx(55.0 if ramp == "linear" else 10.0 * 10 ** 0.5)
        drawn = gaps(due_offsets(spec, 100.0, 1001))
        # Mean gaps of the first and last 200 requests: about 1/10-ish s against 1/100-ish s.
        assert statistics.fmean(drawn[:200]) > 3 * statistics.fmean(drawn[-200:]), ramp


def test_a_concurrency_cap_holds_and_the_waits_for_a_slot_are_recorded():
    # ~70 ms per request at 200 requests/s: about 14 would be in flight without the cap.
    with SchedServer(ttft_ms=20, gap_ms=10, default_max_tokens=6) as capped:
        capped.server.__class__ = PeakServer
        capped.server._running = capped.server.__dict__.pop("running")
        level = run_rate(spec_for(capped, max_tokens=6, min_requests=60, rate_duration_s=0.1, max_concurrency=3), 200.0)
        peak = capped.server.peak
    assert level.completed == 60 and level.concurrency == level.max_concurrency == 3
    assert peak == 3  # the server never streamed more than the cap at once, and did reach it
    waited = [r for r in level.records if r.slot_wait > 0]
    assert waited and level.slot_wait_ms["count"] == len(waited)
    assert all(r.start - r.due >= r.slot_wait for r in waited)  # the wait is part of the lag


def test_a_sweep_runs_the_rate_levels_after_the_concurrency_levels(server):
    levels, ticks = [], []
    result = sweep(spec_for(server, levels=(2,), rates=(40.0, 80.0), min_requests=20, requests_per_user=2),
                   on_level=levels.append, on_tick=ticks.append)
    assert [(lv.kind, lv.concurrency, lv.rate) for lv in result.levels] == [
        ("concurrency", 2, 0.0), ("rate", 0, 40.0), ("rate", 0, 80.0)]
    assert levels == result.levels and [lv.num_requests for lv in levels] == [20, 20, 40]
    assert {t.rate for t in ticks} <= {0.0, 40.0, 80.0} and any(t.rate == 80.0 for t in ticks)
    assert result.single_stream_tok_s is None  # no concurrency 1 level; a rate level is never it


def test_a_sweep_of_rates_only_needs_no_concurrency_level(server):
    result = sweep(spec_for(server, rates=(60.0,), min_requests=12, rate_duration_s=0.1))
    assert [lv.label for lv in result.levels] == ["60 req/s"] and result.levels[0].completed == 12
