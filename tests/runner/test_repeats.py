"""A plain run's repeats against the known-schedule server: each level measured `repeats` times in a row, each repeat
with prompts (and a rate level's arrivals) of its own seed, and the saturation rule reading a level as its repeats do.

Nothing here compares timings: counts are exact, and which prompts a repeat sends is what the sweep asked its workers."""
import importlib

import pytest

from benchmarks.runner import COMPLETIONS, LoadSpec, RunnerError, prompts, repeats_problem, sweep
from benchmarks.runner.saturation import representatives
from benchmarks.runner.spec import LevelResult
from tests.runner.test_rate_warmup import server  # noqa: F401 - the known-schedule server, a fixture

sweep_mod = importlib.import_module("benchmarks.runner.sweep")  # the module: the package's `sweep` is the function


def spec_for(server, **overrides):  # noqa: F811 - the fixture's value
    return LoadSpec(**{**dict(base_url=server.base_url, model="sched", endpoint=COMPLETIONS, prompt_source="builtin",
                              ignore_eos=False, max_tokens=3, levels=(1, 2), min_requests=4, requests_per_user=1,
                              warmup_per_user=0, tick_s=0.1, workers=1, seed=5, scrape_metrics=False, repeats=3),
                       **overrides})


def test_each_level_runs_its_repeats_in_a_row_each_with_prompts_of_its_own_seed(server, monkeypatch):
    keys = []
    real = sweep_mod._Command

    def command(*args, **kwargs):
        keys.append(kwargs.get("key"))  # what seeds the level's random prompts (None: the level's own)
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep_mod, "_Command", command)
    result = sweep(spec_for(server, rates=(20.0,), rate_duration_s=0.1))
    assert [(lv.kind, lv.concurrency, lv.rate, lv.repeat) for lv in result.levels] == [
        ("concurrency", 1, 0, 0), ("concurrency", 1, 0, 1), ("concurrency", 1, 0, 2),
        ("concurrency", 2, 0, 0), ("concurrency", 2, 0, 1), ("concurrency", 2, 0, 2),
        ("rate", 0, 20.0, 0), ("rate", 0, 20.0, 1), ("rate", 0, 20.0, 2)]
    assert all(lv.num_requests == lv.completed == 4 for lv in result.levels)
    assert len(server.server.prompt_log) == 9 * 4  # every repeat sent its own requests
    # The first repeat keeps the level's own seed (a run of one repeat sends what it always sent); the others differ.
    assert keys == [None, "1/1", "1/2", None, "2/1", "2/2", "rate20", "rate20/1", "rate20/2"]


def test_a_repeat_s_random_prompts_are_not_the_repeat_before_s():
    spec = LoadSpec(base_url="http://x", model="m", prompt_source="random", input_tokens=16, seed=5)
    target = prompts.Target(spec)
    first, again = ([r.data for r in prompts.share_requests(spec, target, None, 2, 4, 0, [0, 1], key=key)]
                    for key in (None, "2/1"))
    assert len(first) == len(again) == 4 and not set(first) & set(again)


def test_repeats_are_one_to_ten_whole_times():
    assert repeats_problem(1) == repeats_problem(10) == ""
    for bad in (0, 11, 2.5, True, "3"):
        assert "repeats is a whole number from 1 to 10" in repeats_problem(bad)
    with pytest.raises(RunnerError, match="repeats is a whole number"):
        sweep(LoadSpec(base_url="http://x", model="m", levels=(1,), repeats=0))


def test_the_saturation_rule_reads_each_level_as_the_median_of_its_repeats():
    def lv(c, tok_s, repeat):
        return LevelResult(concurrency=c, num_requests=8, completed=8, output_throughput=tok_s, repeat=repeat,
                           e2e_ms={"median": 100.0 * c})

    levels = [lv(1, 100, 0), lv(1, 900, 1), lv(1, 110, 2), lv(2, 200, 0), lv(2, 190, 1), lv(2, 210, 2)]
    picked = representatives(levels)
    assert [(p.concurrency, p.output_throughput) for p in picked] == [(1, 110), (2, 200)]
    assert representatives([lv(4, 300, 0), lv(4, 100, 1)])[0].output_throughput == 100  # the lower middle of two
