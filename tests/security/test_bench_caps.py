"""Benchmarks cannot take the host down: a run asking for more than the deployment's max model
length, the requests per level or the prompt bytes allowed is refused with a 400 that names the limit
and what was asked (API, form, studies), before anything is queued; prompts are made one at a time."""
import tracemalloc

import pytest

from benchmarks.models import BenchmarkRun, Study
from benchmarks.runner import LoadSpec, prompt_bytes
from benchmarks.runner.prompts import Target, share_requests
from benchmarks.runner.tokens import PromptLengths
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
HUGE = {"prompt_source": "random", "input_tokens": 200_000, "min_requests": 100_000}
URL = "http://10.0.0.5:8000"


@pytest.fixture
def url_allowed(settings):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]


@pytest.fixture
def tiny(sent_tasks):
    """A ready deployment whose engine takes 2,048 tokens (--max-model-len), of a model made for 32,768."""
    node = NodeFactory(name="cpu-01", engine_flags=["--max-num-seqs", "--max-model-len"], agent_pid=100)
    copy = ModelCopyFactory(node=node, model=ModelRepoFactory(context_length=32_768))
    return DeploymentFactory(node=node, model=copy.model, status="ready", engine_args={"max-model-len": 2048})


def refusal(answer) -> tuple[str, str]:
    assert answer.status_code == 400, answer.content
    error = answer.json()["error"]
    (field, (message,)), = error["fields"].items()
    return field, message


def test_200000_token_prompts_times_100000_requests_are_refused_naming_the_limit(api, url_allowed, sent_tasks):
    field, message = refusal(api.post("/api/runs/", {"base_url": URL, **HUGE}, format="json"))
    # The default levels end at 1024: 100,000 measured + 1,024 warm-up requests there.
    assert field == "min_requests"
    assert "101,024 requests" in message and "limit is 100,000 per level" in message
    assert "PANEL_BENCH_MAX_REQUESTS_PER_LEVEL" in message
    # Within the request count (one level, no warm-up), the prompt bytes are still ~90 GiB.
    field, message = refusal(api.post("/api/runs/", {"base_url": URL, **HUGE, "levels": [1], "warmup_per_user": 0},
                                      format="json"))
    assert field == "input_tokens" and "PANEL_BENCH_MAX_PROMPT_BYTES" in message
    assert "about 90.3 GiB of prompts (100,000 requests" in message and "limit is 8.0 GiB per run" in message
    assert not BenchmarkRun.objects.exists() and not sent_tasks


def test_the_limits_are_settings(api, url_allowed, settings):
    settings.BENCH_MAX_REQUESTS_PER_LEVEL = 10
    field, message = refusal(api.post("/api/runs/", {"base_url": URL, "levels": [4], "requests_per_user": 3, "min_requests": 1},
                                      format="json"))
    assert field == "requests_per_user" and "16 requests (12 measured + 4 warm-up)" in message
    assert "the limit is 10 per level" in message
    settings.BENCH_MAX_REQUESTS_PER_LEVEL, settings.BENCH_MAX_PROMPT_BYTES = 100, 1000
    _, message = refusal(api.post("/api/runs/", {"base_url": URL, "levels": [1], "prompt_source": "builtin"},
                                  format="json"))
    assert "limit is 1,000 bytes per run" in message


def test_prompts_and_outputs_longer_than_the_max_model_length_are_refused(api, tiny):
    field, message = refusal(api.post("/api/runs/", {"deployment": tiny.pk, **HUGE}, format="json"))
    assert field == "input_tokens"
    assert "200000 + 128 = 200128, more than the max model length 2048" in message and "--max-model-len" in message
    field, message = refusal(api.post("/api/runs/", {"deployment": tiny.pk, "prompt_source": "builtin",
                                                     "max_tokens": 4096}, format="json"))
    assert field == "max_tokens" and "max_tokens 4096 leaves no room for a prompt" in message
    # Exactly the max model length fits: vLLM's own rule is prompt + max_tokens <= max_model_len.
    ok = api.post("/api/runs/", {"deployment": tiny.pk, "prompt_source": "random", "input_tokens": 1920,
                                 "max_tokens": 128, "levels": [1]}, format="json")
    assert ok.status_code == 202, ok.content


def test_without_a_max_model_len_flag_the_models_context_length_is_the_limit(api, tiny):
    tiny.engine_args = {"max-model-len": "auto"}  # vLLM picks one; the model's own length bounds it
    tiny.save()
    _, message = refusal(api.post("/api/runs/", {"deployment": tiny.pk, "prompt_source": "random",
                                                 "input_tokens": 32_700, "max_tokens": 128}, format="json"))
    assert "more than the max model length 32768" in message and "its model's context length" in message


def test_the_form_shows_the_refusal_on_the_field(operator_client, tiny):
    page = operator_client.post("/benchmarks/", {
        "deployment": tiny.pk, "levels": "1,8", "endpoint": "/v1/chat/completions", "prompt_source": "random",
        "input_tokens": 200_000, "max_tokens": 128, "temperature": 0, "requests_per_user": 4})
    assert page.status_code == 400
    assert page.context["form"].errors["input_tokens"] == [
        f"input_tokens + max_tokens = 200000 + 128 = 200128, more than the max model length 2048 of {tiny.name} "
        "(its --max-model-len)."]
    assert "200128, more than the max model length 2048" in page.content.decode()
    page = operator_client.post("/benchmarks/", {
        "deployment": tiny.pk, "levels": "4096", "endpoint": "/v1/chat/completions", "prompt_source": "builtin",
        "input_tokens": 128, "max_tokens": 128, "temperature": 0, "requests_per_user": 1000})
    assert page.status_code == 400
    assert "4,096,000 measured + 4,096 warm-up" in page.context["form"].errors["requests_per_user"][0]
    assert not BenchmarkRun.objects.exists()


def test_a_study_is_refused_before_it_starts_for_its_workload_or_a_variants_max_model_len(api, tiny):
    tiny.engine_args = {}  # the model's 32,768 tokens
    tiny.save()
    body = {"deployment": tiny.pk, "variants": [{"name": "short", "engine_args": {"max-model-len": 1024}}],
            "workload": {"levels": [1], "prompt_source": "random", "input_tokens": 2000, "max_tokens": 100}}
    field, message = refusal(api.post("/api/studies/", body, format="json"))
    assert field == "input_tokens" and f"max model length 1024 of {tiny.name} as short" in message
    body["workload"] = HUGE
    _, message = refusal(api.post("/api/studies/", body, format="json"))
    assert "more than the max model length 32768" in message
    body["workload"] = {"levels": [64], "min_requests": 100_000}
    _, message = refusal(api.post("/api/studies/", body, format="json"))
    assert "PANEL_BENCH_MAX_REQUESTS_PER_LEVEL" in message
    assert not Study.objects.exists()


def test_a_huge_levels_prompts_are_made_one_at_a_time():
    """100,000 requests of 200,000-token prompts (~90 GiB if built up front, as before): a worker's share
    makes each prompt when it is taken, so the first few cost about one prompt's memory."""
    spec = LoadSpec(base_url="http://gpu1:8000", model="m", prompt_source="random", input_tokens=200_000,
                    min_requests=100_000)
    assert prompt_bytes(spec, 100_000) > 90 * 2**30
    lengths = PromptLengths().costed()
    tracemalloc.start()
    try:
        requests = share_requests(spec, Target(spec), lengths, level=64, total=100_064, warmup=64, slots=list(range(32)))
        first = [next(requests)[2] for _ in range(3)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(len(data) > 900_000 for data in first) and len(set(first)) == 3  # full-size, distinct prompts
    assert peak < 12 * 2**20, peak  # three of them and one being made, not 100,000


def test_random_prompts_differ_across_levels_and_keep_their_exact_length():
    spec = LoadSpec(base_url="http://x", model="m", prompt_source="random", input_tokens=300)
    lengths = PromptLengths().costed()
    one = [r[2] for r in share_requests(spec, Target(spec), lengths, level=1, total=3, warmup=0, slots=[0])]
    two = [r[2] for r in share_requests(spec, Target(spec), lengths, level=2, total=3, warmup=0, slots=[0, 1])]
    assert not set(one) & set(two)  # a later level never reuses an earlier one's prompts (prefix caching)
    again = [r[2] for r in share_requests(spec, Target(spec), lengths, level=2, total=3, warmup=0, slots=[0, 1])]
    assert again == two  # the seed decides
    # Words cost one token each here, so the token count is the word count.
    assert {len(data.split(b'"content":"')[1].split(b'"')[0].split()) for data in one + two} == {300}
