"""Random prompts sized in the served model's tokens: from the model's tokenizer files when the server
has no /tokenize (the real engine's /tokenize is checked in tests/e2e/test_first_hour.py)."""
import random

import pytest

from benchmarks.runner import tokens
from benchmarks.runner.prompts import prompt_entries
from benchmarks.runner.spec import COMPLETIONS, LoadSpec
from tests.conftest import free_port


@pytest.fixture
def no_server():
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: no /tokenize


def test_prompts_from_the_tokenizer_files_have_exactly_the_requested_tokens(no_server, tiny_model_files):
    spec = LoadSpec(base_url=no_server, model="m", endpoint=COMPLETIONS, tokenizer_path=str(tiny_model_files))
    lengths = tokens.prompt_lengths(spec, no_server)
    assert lengths.source == tokens.FILES
    rng = random.Random(3)
    for want in (8, 32, 64, 200):
        prompt = lengths.prompt(rng, want)
        assert lengths.measure(prompt) == want, (want, prompt)


def test_random_prompts_differ_and_repeat_with_the_seed(no_server, tiny_model_files):
    spec = LoadSpec(base_url=no_server, model="m", endpoint=COMPLETIONS, prompt_source="random", input_tokens=40,
                    tokenizer_path=str(tiny_model_files))
    lengths = tokens.prompt_lengths(spec, no_server)
    first, again = list(prompt_entries(spec, 4, lengths)), list(prompt_entries(spec, 4, lengths))
    assert first == again and len({e["prompt"] for e in first}) == 4


def test_without_a_server_tokenizer_or_files_a_word_is_a_token(no_server, tmp_path):
    spec = LoadSpec(base_url=no_server, model="m", tokenizer_path=str(tmp_path))  # no tokenizer.json there
    lengths = tokens.prompt_lengths(spec, no_server)
    assert lengths.source == tokens.WORDS_ONLY and lengths.measure("a b") is None
    assert len(lengths.prompt(random.Random(0), 25).split()) == 25


def test_chat_prompts_from_files_say_the_template_is_not_counted(no_server, tiny_model_files):
    lengths = tokens.prompt_lengths(LoadSpec(base_url=no_server, model="m", tokenizer_path=str(tiny_model_files)), no_server)
    assert lengths.source.startswith(tokens.FILES) and "chat template not counted" in lengths.source
