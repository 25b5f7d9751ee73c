"""A rate level's warm-up against the known-schedule server: warmup_per_user seconds of the schedule go first and
none of them is counted. Each request's prompt has its own length (request i sends i + 1 words), so the
server's own log, in arrival order, says which requests it got, and the level's figures say which it counted.

Nothing here compares timings: counts and token sums are exact, and the schedules are seeded draws.
"""
import random

import pytest

from benchmarks.runner import COMPLETIONS, LoadSpec, due_offsets, run_rate
from benchmarks.runner.arrivals import rate_warmup, with_warmup
from tests.schedserver import SchedServer

PROMPTS = [{"prompt": " ".join(["w"] * (i + 1))} for i in range(200)]


@pytest.fixture
def server():
    with SchedServer(ttft_ms=2, gap_ms=1) as running:
        yield running


def spec_for(server, **overrides):
    fields = dict(base_url=server.base_url, model="sched", endpoint=COMPLETIONS, prompt_source="jsonl", prompts=PROMPTS,
                  ignore_eos=False, max_tokens=3, levels=(), min_requests=12, rate_duration_s=0.1, tick_s=0.1,
                  workers=1, seed=5, warmup_per_user=1)
    fields.update(overrides)
    return LoadSpec(**fields)


def test_the_warm_up_requests_go_first_and_are_left_out_of_the_levels_figures(server):
    spec = spec_for(server)
    level = run_rate(spec, 20.0)
    warmup = rate_warmup(spec, 20.0, 12)
    assert warmup == 12 and level.warmup_requests == warmup  # ⌈20/s⌉ × 1 s, at most the level's 12
    # The server got the warm-up and the measured requests (each its own length); the level counts the measured only.
    assert sorted(server.server.prompt_log) == list(range(1, warmup + 12 + 1))
    assert level.num_requests == level.completed == 12
    assert sorted(r.index for r in level.records) == list(range(warmup, warmup + 12))
    assert [r.prompt_tokens for r in level.records] == [i + 1 for i in range(warmup, warmup + 12)]
    assert level.input_tokens == sum(range(warmup + 1, warmup + 13))
    # The measured schedule is the one drawn without a warm-up, started after it.
    first = level.records[0].due
    assert [r.due - first for r in level.records] == pytest.approx(due_offsets(spec, 20.0, 12), abs=1e-9)
    assert all(r.start >= r.due for r in level.records)


def test_without_a_warm_up_every_request_is_measured(server):
    level = run_rate(spec_for(server, warmup_per_user=0), 20.0)
    assert level.warmup_requests == 0 and level.num_requests == len(server.server.prompt_log) == 12
    assert sorted(r.prompt_tokens for r in level.records) == list(range(1, 13))


def test_the_warm_up_is_seconds_of_the_schedule_drawn_from_its_own_seed():
    spec = LoadSpec(base_url="http://x", model="m", seed=9, warmup_per_user=2)
    assert rate_warmup(spec, 2.5, 100) == 6  # 2 seconds at ⌈2.5⌉ a second
    assert rate_warmup(spec, 2.5, 4) == 4  # never more than the level measures
    due = due_offsets(spec, 2.5, 5)
    full = with_warmup(spec, 2.5, due, 6)
    rng = random.Random("9/warmup/2.5")
    gaps = [rng.gammavariate(1.0, 1 / 2.5) for _ in range(6)]
    assert full[:6] == pytest.approx([sum(gaps[:i]) for i in range(6)])
    assert [t - full[6] for t in full[6:]] == pytest.approx(due)  # the measured schedule, unchanged
    assert full[6] == pytest.approx(sum(gaps))
    assert with_warmup(spec, 2.5, due, 0) == due
