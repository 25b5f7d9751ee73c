"""A request's timeout follows its own size (its max_tokens at a floor rate per stream, plus time for its first
token) unless the spec sets one; a request that runs past it counts as a timeout, apart from the other errors."""
import json

import pytest

from benchmarks.runner import LoadSpec, RunnerError, run_level, sweep
from benchmarks.runner import spec as spec_mod
from benchmarks.runner.prompts import Target, load_jsonl, share_requests
from tests.schedserver import SchedServer


def spec_for(base_url="http://h:8000", **overrides):
    fields = dict(base_url=base_url, model="sched", prompt_source="builtin", ignore_eos=False, max_tokens=4,
                  min_requests=4, requests_per_user=1, warmup_per_user=0, tick_s=0.1, workers=1)
    return LoadSpec(**{**fields, **overrides})


def test_the_timeout_follows_max_tokens_at_the_floor_rate_plus_time_for_the_first_token():
    auto = spec_for()
    assert auto.request_timeout_s is None  # no fixed timeout unless asked
    floor, first = spec_mod.TIMEOUT_FLOOR_TOK_S, spec_mod.TIMEOUT_FIRST_TOKEN_S
    assert spec_mod.request_timeout(auto, 128) == spec_mod.MIN_REQUEST_TIMEOUT_S  # a short answer: the minimum
    assert spec_mod.request_timeout(auto, 8192) == first + 8192 / floor
    assert spec_mod.request_timeout(auto, 200_000) == spec_mod.MAX_REQUEST_TIMEOUT_S  # never past the maximum
    # The case: 2,276 tok/s shared by 1,024 streams is ~2.2 tok/s each; a 4,000-token reasoning answer
    # then takes ~1,800 s, three times the fixed 600 s of before, and within its own timeout.
    per_stream = 2276 / 1024
    assert 4000 / per_stream > 600 and 4000 / per_stream < spec_mod.request_timeout(auto, 4000)
    assert spec_mod.request_timeout(spec_for(request_timeout_s=45.0), 8192) == 45.0  # set: as set


@pytest.mark.parametrize("value, says", [(0, "above 0"), (-5, "above 0"), (float("nan"), "above 0"),
                                         (10**9, "at most"), ("soon", "a number of seconds")])
def test_a_timeout_that_cannot_be_is_refused_with_the_rule(value, says):
    assert says in spec_mod.timeout_problem(value)
    assert spec_mod.timeout_problem(None) == "" and spec_mod.timeout_problem(900) == ""
    with pytest.raises(RunnerError, match="request_timeout_s"):
        sweep(spec_for(request_timeout_s=value, levels=(1,)))


def test_each_request_carries_the_timeout_of_its_own_max_tokens():
    prompts = load_jsonl("\n".join(json.dumps({"prompt": "hi", "max_tokens": n}) for n in (16, 4000, 9000)))
    spec = spec_for(prompt_source="jsonl", prompts=prompts)
    requests = list(share_requests(spec, Target(spec), None, level=1, total=3, warmup=0, slots=[0]))
    assert [r.timeout_s for r in requests] == [spec_mod.request_timeout(spec, n) for n in (16, 4000, 9000)]
    assert requests[0].timeout_s < requests[1].timeout_s < requests[2].timeout_s
    fixed = spec_for(prompt_source="jsonl", prompts=prompts, request_timeout_s=30.0)
    assert {r.timeout_s for r in share_requests(fixed, Target(fixed), None, 1, 3, 0, [0])} == {30.0}


def test_a_request_past_its_timeout_is_counted_as_a_timeout_not_as_another_error():
    # The server's first token comes 20 s after the request; each request may take 0.3 s.
    with SchedServer(ttft_ms=20_000, gap_ms=1) as server:
        level = run_level(spec_for(server.base_url, request_timeout_s=0.3), concurrency=2)
        levels = []
        with pytest.raises(RunnerError, match="timed out"):  # every request failed: the sweep says how
            sweep(spec_for(server.base_url, request_timeout_s=0.3, levels=(2,)), on_level=levels.append)
    assert (level.num_requests, level.failed_requests, level.timeouts) == (4, 4, 4)
    assert level.errors == []  # the other errors: none
    assert all(r.timed_out for r in level.records)
    assert levels[0].timeouts == 4


def test_a_level_counts_timeouts_apart_from_its_other_errors():
    from benchmarks.runner import RequestRecord, summarize

    ok = RequestRecord(index=0, success=True, start=1.0, done=2.0, chunk_times=[1.5, 2.0], output_tokens=2)
    late = RequestRecord(index=1, start=1.0, done=3.0, error="timed out after 0.3 s", timed_out=True)
    refused = RequestRecord(index=2, start=1.0, done=1.1, error="HTTP 500: boom")
    level = summarize(4, [ok, late, refused])
    assert (level.failed_requests, level.timeouts, level.errors) == (2, 1, ["HTTP 500: boom"])
    assert level.to_dict()["timeouts"] == 1
