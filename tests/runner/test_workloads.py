"""Workloads beyond random prompts against the known-schedule server, whose own record (each request's
prompt tokens as it counted them, its prefix-cache counters) is the truth; and malformed files refused
with the line and the field.

Nothing here compares timings: token counts are exact, and a turn waiting at least its think time after
the answer before it is a relation the runner guarantees, not a measurement against another.
"""
import collections
import json
import math

import pytest

from benchmarks.runner import LoadSpec, PromptError, run_level, run_rate, workfiles, workloads
from tests.schedserver import SchedServer


@pytest.fixture
def server():
    with SchedServer(ttft_ms=2, gap_ms=1, prefix_cache=True) as running:
        yield running


def spec_for(server, workload, **overrides):
    fields = dict(base_url=server.base_url, model="sched", input_tokens=24, max_tokens=6, min_requests=12,
                  warmup_per_user=0, tick_s=0.1, workers=1, seed=3, workload=workload)
    fields.update(overrides)
    return LoadSpec(**fields)


def test_each_turn_resends_the_history_and_the_server_counts_what_the_runner_said(server):
    spec = spec_for(server, {"kind": "multiturn", "turns": 3, "think_s": 0.05})
    level = run_level(spec, 2)
    total, _ = workloads.level_requests(spec, 2)
    assert level.completed == total == len(server.server.prompt_log)
    for record in level.records:
        assert record.prompt_tokens == workloads.expected_prompt_tokens(spec, record.index)
    expected = collections.Counter(workloads.expected_prompt_tokens(spec, i) for i in range(total))
    assert collections.Counter(server.server.prompt_log) == expected  # the server's own count
    by_index = {r.index: r for r in level.records}
    for record in level.records:
        if record.index % 3:  # a later turn goes only after the answer before it, plus the think time
            assert record.start - by_index[record.index - 1].done >= 0.05


def test_multi_turn_reuse_bounds_the_engines_own_prefix_cache_hits(server):
    spec = spec_for(server, {"kind": "multiturn", "turns": 4, "think_s": 0})
    level = run_level(spec, 3)
    reuse, cache = level.prefix_reuse, level.server_metrics["prefix_cache"]
    assert reuse["prompt_tokens"] == sum(server.server.prompt_log) == cache["queries"]
    # Turn t could reuse turn t - 1's prompt; the engine hits whole 16-token blocks of it.
    assert 0 < cache["hits"] <= reuse["reusable_tokens"]
    assert reuse["reusable_tokens"] - cache["hits"] < 16 * level.completed


def test_a_prefix_set_shares_k_prefixes_and_the_engine_hits_exactly_them(server):
    spec = spec_for(server, {"kind": "prefix", "prefixes": 3, "prefix_tokens": 32}, input_tokens=10)
    level = run_level(spec, 2)
    assert level.completed == spec.num_requests(2)
    assert set(server.server.prompt_log) == {32 + 10}
    assert level.prefix_reuse["reusable_tokens"] == (level.completed - 3) * 32
    assert level.server_metrics["prefix_cache"]["hits"] == level.prefix_reuse["reusable_tokens"]


def trace_lines(n=12):
    lines = []
    for i in range(n):  # two conversations' worth of shared leading blocks, then each request's own
        ids = [i % 2, 10 + i]
        lines.append(json.dumps({"timestamp": 250 * i + (40 if i % 3 == 0 else 0), "input_length": 600 + i,
                                 "output_length": 3 + i % 4, "hash_ids": ids}))
    return "\n".join(lines)


def test_a_trace_is_replayed_at_its_own_times_scaled_to_the_rate(server):
    requests = workfiles.mooncake(trace_lines())
    workload = {"kind": "trace", "block_tokens": workfiles.TRACE_BLOCK_TOKENS, "requests": requests}
    spec = spec_for(server, workload, levels=(), min_requests=len(requests), rate_duration_s=0.1)
    native = workloads.trace_rate(workload)
    level = run_rate(spec, 2 * native)  # 2x: every gap halved
    assert level.completed == len(requests)
    first = min(r.due for r in level.records)
    for record in level.records:
        assert record.due - first == pytest.approx((requests[record.index][0] - requests[0][0]) / 1000 / 2)
        assert record.start >= record.due
        assert record.prompt_tokens == requests[record.index][1]
        assert record.output_tokens == requests[record.index][2]
    assert sorted(server.server.prompt_log) == sorted(r[1] for r in requests)
    # Leading block 0 or 1 is shared: every request after the first two could reuse its 512 tokens.
    assert level.prefix_reuse["reusable_tokens"] == (len(requests) - 2) * 512
    assert level.server_metrics["prefix_cache"]["hits"] == level.prefix_reuse["reusable_tokens"]


def test_sharegpt_conversations_send_their_first_turn_with_the_reply_length(server):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question number {i} " * (i + 1)},
                                              {"from": "gpt", "value": "x" * (4 * i + 5)}]} for i in range(5)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "alone"}]})  # skipped, as vLLM does
    entries = workfiles.sharegpt(json.dumps(convs, indent=1))
    assert len(entries) == 5
    spec = spec_for(server, {"kind": "sharegpt", "entries": entries}, min_requests=5)
    level = run_level(spec, 1)
    assert sorted(server.server.prompt_log) == sorted(3 * (i + 1) for i in range(5))
    assert sorted(r.output_tokens for r in level.records) == sorted(math.ceil((4 * i + 5) / 4) for i in range(5))


@pytest.mark.parametrize("text, message", [
    ('[\n {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},\n'
     ' {"conversations": [{"from": "human"}, {"from": "gpt", "value": "yo"}]}\n]',
     'line 3: field "conversations[0].value" must be a string'),
    ('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}\n{"id": 2}',
     'line 2: field "conversations" must be a list'),
    ('{"conversations": [{"from": "robot", "value": "a"}]}', 'line 1: field "conversations[0].from" must be one of'),
    ('[{"conversations": []},\n  {"conversations": [}]', "line 2: not valid JSON"),
])
def test_a_malformed_sharegpt_file_is_refused_naming_the_line_and_the_field(text, message):
    with pytest.raises(PromptError) as caught:
        workfiles.sharegpt(text)
    assert message in str(caught.value)


@pytest.mark.parametrize("text, message", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
     '{"timestamp": 5, "output_length": 2, "hash_ids": [1]}', 'line 2: field "input_length" must be a number'),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, -4]}',
     'line 1: field "hash_ids" must be a list of whole numbers'),
    ('{"timestamp": 9, "input_length": 10, "output_length": 2, "hash_ids": []}\n\n'
     '{"timestamp": 3, "input_length": 10, "output_length": 2, "hash_ids": []}', 'line 3: field "timestamp" 3 is before'),
    ('{"timestamp": 0, "input_length": 10.5, "output_length": 2}', 'line 1: field "input_length" must be a whole number'),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 0, "input_length": 10, "output_length": 2}',
     "every \"timestamp\" is the same"),
    # An 80-byte line asking for 40 million tokens (its preview took 12 s of a web thread, 1e8 never answered).
    ('{"timestamp": 0, "input_length": 40000000, "output_length": 2}', 'line 1: field "input_length" is 40,000,000 '
                                                                         "tokens, more than any model takes"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 99999999}', 'line 1: field "output_length" is 99,999,999'),
    ("\n".join(f'{{"timestamp": {i}, "input_length": 10485760, "output_length": 1}}' for i in range(60)),
     "line 49: the trace's prompts reach 1,000,000 blocks of 512 tokens"),
])
def test_a_malformed_trace_is_refused_naming_the_line_and_the_field(text, message):
    with pytest.raises(PromptError) as caught:
        workfiles.mooncake(text)
    assert message in str(caught.value)


def test_a_request_as_long_as_the_bound_is_cut_into_its_blocks_and_previewed():
    """The blocks of a trace request: full ones, then what is left; 20,480 of them at the bound."""
    assert workloads._block_sizes(1300, 3, 512) == [512, 512, 276] and workloads._block_sizes(1024, 5, 512) == [512, 512]
    assert workloads._block_sizes(1300, 2, 512) == [512, 512]  # fewer hash ids than blocks: those only
    line = f'{{"timestamp": 0, "input_length": {workfiles.MAX_TRACE_TOKENS}, "output_length": 8}}\n'
    requests = workfiles.mooncake(line + line.replace('"timestamp": 0', '"timestamp": 5'))
    assert [len(r[3]) for r in requests] == [workfiles.MAX_TRACE_TOKENS // 512] * 2
    trace = {"kind": "trace", "block_tokens": 512, "requests": requests}
    view = workfiles.preview(LoadSpec(base_url="http://x", model="m", workload=trace))
    assert view["prompt_tokens"]["max"] == workfiles.MAX_TRACE_TOKENS and view["prefix_reuse"]["share"] == 0.0


def test_a_preview_shows_lengths_and_what_a_prefix_cache_could_serve():
    spec = LoadSpec(base_url="http://x", model="m", input_tokens=10, max_tokens=5,
                    workload={"kind": "multiturn", "turns": 2, "think_s": 1})
    view = workfiles.preview(spec)
    assert view["prompt_tokens"]["min"] == 10 and view["prompt_tokens"]["max"] == 10 + 5 + 10
    assert view["prefix_reuse"]["reusable_tokens"] == 10 * view["prompt_tokens"]["count"] // 2
    trace = {"kind": "trace", "block_tokens": 512, "requests": workfiles.mooncake(trace_lines(5))}
    view = workfiles.preview(LoadSpec(base_url="http://x", model="m", workload=trace))
    assert view["requests"] == 5 and view["rate"] == pytest.approx(4 / 0.96, abs=1e-4)  # 40 ms to 1000 ms
    assert view["prompt_tokens"]["max"] == 604


def test_a_capacity_search_on_a_trace_replays_it_at_each_rounds_rate(server):
    """'How many requests/s at p90 TTFT <= 5 s on this traffic': each round replays the trace, time-scaled."""
    from benchmarks.runner import slo, sweep

    requests = workfiles.mooncake(trace_lines())
    workload = {"kind": "trace", "block_tokens": workfiles.TRACE_BLOCK_TOKENS, "requests": requests}
    spec = spec_for(server, workload, levels=(), min_requests=len(requests), rate_duration_s=0.1, scrape_metrics=False,
                    slos=slo.parse("ttft:p90:5s"), capacity={"low": 4, "high": 12, "width": 2, "repeats": 1})
    seen = []
    result = sweep(spec, on_level=seen.append)
    assert [r["rate"] for r in result.capacity["rounds"]] == [lv.rate for lv in seen] == [8.0, 10.0]
    native = workloads.trace_rate(workload)
    for level in seen:
        first = min(r.due for r in level.records)
        scale = level.rate / native
        for record in level.records:
            assert record.due - first == pytest.approx((requests[record.index][0] - requests[0][0]) / 1000 / scale)
    assert result.capacity["rate"] == 10.0


def test_a_cancel_ends_a_multi_turn_level_while_its_users_think(server):
    import time

    spec = spec_for(server, {"kind": "multiturn", "turns": 3, "think_s": 60})
    asked = time.monotonic()
    level = run_level(spec, 2, cancel=lambda: time.monotonic() - asked > 2)
    assert level.cancelled
    assert time.monotonic() - asked < 60  # not the 60 s think time (whatever else the host does): the users woke
