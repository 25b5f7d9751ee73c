"""Uploaded JSONL prompts are validated with messages that name the line and the problem."""
import random

import pytest

from benchmarks.runner import COMPLETIONS, LoadSpec, PromptError, load_jsonl
from benchmarks.runner.prompts import Target, prompt_entries, random_prompt, request_body


def test_jsonl_accepts_prompts_and_chat_messages_and_skips_blank_lines():
    text = '{"prompt": "hello"}\n\n{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}\n'
    assert load_jsonl(text) == [{"prompt": "hello"},
                                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}]


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "ok"}\n{"prompt": "broken"', "line 2: not valid JSON"),
    ('["a list"]', "line 1: expected an object"),
    ('{"prompt": "a", "messages": []}', 'line 1: needs exactly one of "prompt" or "messages"'),
    ('{"text": "a"}', 'line 1: needs exactly one of "prompt" or "messages"'),
    ('{"prompt": "   "}', 'line 1: "prompt" must be a non-empty string'),
    ('{"messages": []}', 'line 1: "messages" must be a non-empty list'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 1: message 1 needs a role"),
    ('{"messages": [{"role": "user"}]}', 'line 1: message 1 needs "content"'),
    ('{"prompt": "a", "max_tokens": 0}', '"max_tokens" must be a positive integer'),
    ("\n\n", "the file has no prompts"),
])
def test_jsonl_errors_say_which_line_is_wrong_and_why(text, message):
    with pytest.raises(PromptError) as error:
        load_jsonl(text)
    assert message in str(error.value)
    assert error.value.permanent


def test_chat_messages_are_refused_for_the_completions_endpoint():
    with pytest.raises(PromptError, match='"messages" need the chat endpoint'):
        load_jsonl('{"messages": [{"role": "user", "content": "hi"}]}', endpoint=COMPLETIONS)


def test_random_prompts_have_the_requested_number_of_words_and_differ():
    spec = LoadSpec(base_url="http://x", model="m", prompt_source="random", input_tokens=50)
    entries = list(prompt_entries(spec, 3))
    assert all(len(e["prompt"].split()) == 50 for e in entries)
    assert len({e["prompt"] for e in entries}) == 3
    assert random_prompt(random.Random(1), 5) == random_prompt(random.Random(1), 5)


def test_request_body_asks_for_streamed_usage_and_vllm_extras():
    spec = LoadSpec(base_url="http://x", model="m", max_tokens=64, ignore_eos=True, temperature=0.7,
                    continuous_usage_stats=True, extra_body={"top_p": 0.9})
    body = request_body(spec, {"prompt": "hi", "max_tokens": 9})
    assert body["stream"] is True and body["max_tokens"] == 9 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["top_p"] == 0.9


def test_target_accepts_a_base_url_with_or_without_v1():
    assert Target(LoadSpec(base_url="http://gpu1:8000/v1", model="m")).path == "/v1/chat/completions"
    target = Target(LoadSpec(base_url="https://proxy/llm/", model="m", endpoint=COMPLETIONS, api_key="k"))
    assert (target.host, target.port, target.tls, target.path) == ("proxy", 443, True, "/llm/v1/completions")
    assert b"Authorization: Bearer k\r\n" in target.request_bytes({"a": 1})
