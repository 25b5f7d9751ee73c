"""Multi-turn conversations at request rates, and think times drawn from a seeded distribution, against the
known-schedule server, whose own log of prompt tokens is the truth.

Each conversation starts at a scheduled arrival (the rate is of conversations) and its later turns follow their
think times. Nothing here compares timings: token counts are exact, the arrivals are a seeded draw, a first turn
never leaves before its due time and a later turn never before the answer before it plus its think time (both
guaranteed by the runner, not measured against anything).
"""
import collections
import random

import pytest

from benchmarks.runner import LoadSpec, due_offsets, run_level, run_rate, workloads
from tests.runner.test_rates import PeakServer
from tests.schedserver import SchedServer

TURNS = 3


@pytest.fixture
def server():
    with SchedServer(ttft_ms=2, gap_ms=1, prefix_cache=True) as running:
        yield running


def spec_for(server, workload=None, **overrides):
    fields = dict(base_url=server.base_url, model="sched", input_tokens=20, max_tokens=4, min_requests=12,
                  rate_duration_s=0.2, warmup_per_user=0, tick_s=0.1, workers=1, seed=4, levels=(),
                  workload=workload or {"kind": "multiturn", "turns": TURNS, "think_s": 0.02})
    fields.update(overrides)
    return LoadSpec(**fields)


def test_each_conversation_starts_at_its_arrival_and_every_turn_sends_what_the_server_counts(server):
    spec = spec_for(server)
    level = run_rate(spec, 25.0)
    conversations, warmup = workloads.rate_conversations(spec, 25.0)
    assert (conversations, warmup) == (5, 0)  # max(12 ÷ 3, 25/s × 0.2 s)
    assert level.kind == "rate" and level.completed == conversations * TURNS == len(server.server.prompt_log)
    for record in level.records:
        assert record.prompt_tokens == workloads.expected_prompt_tokens(spec, record.index)
    expected = collections.Counter(workloads.expected_prompt_tokens(spec, i) for i in range(conversations * TURNS))
    assert collections.Counter(server.server.prompt_log) == expected  # the server's own count, turn by turn
    assert server.server.prompt_log.count(spec.input_tokens) == conversations  # one first turn per conversation
    by_index = {r.index: r for r in level.records}
    firsts = [by_index[k * TURNS] for k in range(conversations)]
    # The first turns keep the seeded arrivals, exactly, and never leave before them.
    assert [r.due - firsts[0].due for r in firsts] == pytest.approx(due_offsets(spec, 25.0, conversations), abs=1e-9)
    assert all(r.start >= r.due for r in firsts)
    for record in level.records:
        if record.index % TURNS:  # a later turn: no due time of its own, after the answer before it and the think
            assert record.due == 0 and record.start - by_index[record.index - 1].done >= 0.02
    # The schedule lag and the rate sent are the first turns' only.
    assert level.lag_ms["max"] == pytest.approx(max(r.start - r.due for r in firsts) * 1000)
    starts = sorted(r.start for r in firsts)
    assert level.achieved_rate == pytest.approx((conversations - 1) / (starts[-1] - starts[0]))
    assert 0 < level.prefix_reuse["reusable_tokens"] < level.prefix_reuse["prompt_tokens"] == sum(server.server.prompt_log)


def test_a_multi_turn_rate_levels_warm_up_conversations_are_sent_and_not_counted(server):
    spec = spec_for(server, warmup_per_user=1)
    level = run_rate(spec, 4.0)
    conversations, warmup = workloads.rate_conversations(spec, 4.0)
    assert (conversations, warmup) == (4, 4)
    assert len(server.server.prompt_log) == (conversations + warmup) * TURNS
    assert level.warmup_requests == warmup * TURNS and level.completed == conversations * TURNS
    assert sorted(r.index for r in level.records) == list(range(warmup * TURNS, (warmup + conversations) * TURNS))


def test_a_cap_on_a_multi_turn_rate_level_holds_and_its_slot_waits_are_first_turns(server):
    server.server.__class__ = PeakServer
    server.server._running = server.server.__dict__.pop("running")
    level = run_rate(spec_for(server, max_concurrency=2, rate_duration_s=0.3), 40.0)
    assert level.completed == 12 * TURNS and level.max_concurrency == 2
    assert server.server.peak <= 2  # the server's own count of requests streaming at once
    waited = [r for r in level.records if r.slot_wait > 0]
    assert level.slot_wait_ms["count"] == len(waited)
    assert all(r.index % TURNS == 0 and r.start - r.due >= r.slot_wait for r in waited)


def test_think_times_are_seeded_draws_of_the_asked_distribution():
    exponential = {"kind": "multiturn", "turns": 3, "think": "exponential", "think_s": 2.0, "think_seed": 5}
    uniform = {"kind": "multiturn", "turns": 3, "think": "uniform", "think_min_s": 1.0, "think_max_s": 3.0,
               "think_seed": 5}
    for i in range(1, 50):
        assert workloads.think_time(exponential, i) == random.Random(f"5/think/{i}").expovariate(0.5)
        assert workloads.think_time(uniform, i) == random.Random(f"5/think/{i}").uniform(1.0, 3.0)
        assert 1.0 <= workloads.think_time(uniform, i) <= 3.0
    other_seed = {**exponential, "think_seed": 6}
    assert [workloads.think_time(exponential, i) for i in range(10)] != [workloads.think_time(other_seed, i) for i in range(10)]
    assert workloads.think_time({"kind": "multiturn", "turns": 3, "think_s": 1.5}, 7) == 1.5  # fixed by default
    summary = workloads.think_summary(uniform)
    assert summary["think"] == "uniform" and 1.0 <= summary["drawn_s"]["p10"] <= summary["drawn_s"]["p90"] <= 3.0


def test_each_later_turn_waits_its_own_drawn_think_time(server):
    workload = {"kind": "multiturn", "turns": TURNS, "think": "uniform", "think_min_s": 0.005, "think_max_s": 0.05,
                "think_seed": 11}
    spec = spec_for(server, workload)
    level = run_level(spec, 2)
    by_index = {r.index: r for r in level.records}
    later = [r for r in level.records if r.index % TURNS]
    assert later and level.completed == len(server.server.prompt_log)
    for record in later:
        assert record.start - by_index[record.index - 1].done >= workloads.think_time(workload, record.index)
