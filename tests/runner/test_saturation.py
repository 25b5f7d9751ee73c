"""When a sweep stops by itself: the saturation rule on synthetic level results, and the sweep obeying it."""
import importlib

import pytest

from benchmarks.runner import saturation
from benchmarks.runner.spec import LevelResult, LoadSpec


def level(c, tok_s, e2e_ms, waiting=None):
    metrics = {} if waiting is None else {"num_requests_waiting": {"max": waiting, "mean": waiting / 2}}
    return LevelResult(concurrency=c, num_requests=32, completed=32, output_throughput=tok_s,
                       e2e_ms={"median": e2e_ms}, server_metrics=metrics)


def test_throughput_flat_while_latency_climbs_is_saturation():
    why = saturation.saturated([level(1, 700, 180), level(2, 1300, 190), level(4, 1350, 380)])
    assert "1350 tok/s at concurrency 4" in why and "1300 at 2" in why and "190 to 380 ms" in why


def test_throughput_still_rising_is_not_saturation_even_with_latency_climbing():
    assert saturation.saturated([level(1, 700, 180), level(2, 1200, 400)]) == ""


def test_flat_throughput_with_steady_latency_and_no_queue_is_noise_not_saturation():
    assert saturation.saturated([level(8, 4000, 300, waiting=0), level(16, 4100, 320, waiting=0)]) == ""


def test_flat_throughput_with_a_growing_waiting_queue_is_saturation():
    why = saturation.saturated([level(32, 6000, 700, waiting=0), level(64, 6100, 800, waiting=30)])
    assert "30 requests waited" in why


def test_a_drop_below_the_best_earlier_level_counts_as_flat():
    levels = [level(1, 700, 180), level(2, 1300, 190), level(4, 1250, 200), level(8, 1200, 420)]
    assert "against 1300 at 2" in saturation.saturated(levels)


def test_one_level_or_a_cancelled_one_never_saturates():
    assert saturation.saturated([level(1, 700, 180)]) == ""
    cut = level(2, 100, 900)
    cut.cancelled = True
    assert saturation.saturated([level(1, 700, 180), cut]) == ""


sweep_module = importlib.import_module("benchmarks.runner.sweep")  # the module; the package exports its sweep()


class FakeSweeper:
    """Sweeper's interface, answering each level from a table (no processes, no server)."""

    table: dict = {}

    def __init__(self, spec, max_concurrency, memory_bytes=0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def run_level(self, concurrency, on_tick=None, cancel=None, repeat=0):
        return self.table[concurrency]


@pytest.fixture
def saturating(monkeypatch):
    FakeSweeper.table = {1: level(1, 700, 180), 2: level(2, 1300, 190), 4: level(4, 1350, 380),
                         8: level(8, 1360, 760), 16: level(16, 1370, 1500)}
    monkeypatch.setattr(sweep_module, "Sweeper", FakeSweeper)


def test_a_sweep_stops_after_the_level_where_the_engine_saturated(saturating):
    result = sweep_module.sweep(LoadSpec(base_url="http://x", model="m", levels=(1, 2, 4, 8, 16)))
    assert [lv.concurrency for lv in result.levels] == [1, 2, 4]
    assert "concurrency 4" in result.saturated and not result.cancelled


def test_a_sweep_asked_to_go_on_measures_every_level(saturating):
    result = sweep_module.sweep(LoadSpec(base_url="http://x", model="m", levels=(1, 2, 4, 8, 16),
                                         stop_when_saturated=False))
    assert [lv.concurrency for lv in result.levels] == [1, 2, 4, 8, 16] and result.saturated == ""


def gauged(c, running, waiting, kv):
    return LevelResult(concurrency=c, num_requests=32, completed=32, output_throughput=100.0, e2e_ms={"median": 1.0},
                       server_metrics={"num_requests_running": {"max": running}, "num_requests_waiting": {"max": waiting},
                                       "kv_cache_usage_perc": {"max": kv}})


def test_a_queue_names_max_num_seqs_only_when_as_many_ran_as_it_allows():
    assert "max-num-seqs 16 (16 requests ran at once) was the limit" in saturation.queue_note(gauged(32, 16, 16, 0.2), 16)
    # max-num-seqs 64 with 20 running and the KV cache at 0 %: neither was the limit, and it says so.
    note = saturation.queue_note(gauged(32, 20, 12, 0.0), 64)
    assert "limit" in note and "was the limit" not in note
    assert "at most 20 ran at once of max-num-seqs 64" in note and "at most 0 % used" in note


def test_a_queue_names_the_kv_cache_only_when_it_was_nearly_full():
    assert "the KV cache (97 % used) was the limit" in saturation.queue_note(gauged(64, 40, 24, 0.97), None)
    assert "was the limit" not in saturation.queue_note(gauged(64, 40, 24, 0.5), None)
    assert saturation.queue_note(gauged(8, 8, 0, 0.1), 8) == ""  # nothing waited: nothing to explain


def test_the_saturation_point_is_the_best_level_before_throughput_went_flat():
    levels = [level(1, 700, 180), level(2, 1300, 190), level(4, 1350, 380), level(8, 1360, 800)]
    at, why = saturation.saturation_point(levels)
    assert at == 2 and "1350 tok/s at concurrency 4 against 1300 at 2" in why
    at, why = saturation.saturation_point(levels[:2])
    assert at is None and "still rose 86 % from concurrency 1" in why
