"""A run as commands (benchmarks/runcommand.py): the `panelctl bench` line a run page shows, copied as a user copies
it, makes a run with the same params (the same requests: prompts, seed, levels, rates, SLOs, workload); the `vllm bench
serve` lines exist for random prompts (tests/e2e/test_vllm_bench_lines.py reads them with vLLM's own parser)."""
import html
import shlex

import pytest
from django.urls import reverse
from django.utils import timezone

from benchmarks import runcommand
from benchmarks.models import BenchmarkRun
from panelctl import cli
from plumbing import tokens
from tests.factories import DeploymentFactory

URL = "http://10.2.2.9:8000"
PROMPTS = '{"prompt": "Say hello."}\n{"messages": [{"role": "user", "content": "And goodbye."}]}\n'
BODIES = {
    "defaults": {"levels": [1, 2]},
    "every setting": {"levels": [4, 1], "endpoint": "/v1/completions", "prompt_source": "builtin", "input_tokens": 300,
                      "max_tokens": 700, "temperature": 0.7, "requests_per_user": 2, "min_requests": 8,
                      "warmup_per_user": 0, "ignore_eos": False, "stop_when_saturated": False,
                      "request_timeout_s": 1800, "seed": 42, "repeats": 3},
    "rates and SLOs": {"rates": [4, 2], "burstiness": 0.5, "arrival": "poisson", "max_concurrency": 16, "ramp": "linear",
                       "ramp_from": 1, "rate_duration_s": 20, "slos": "ttft:p99:2s, itl:p95:50ms", "seed": 7},
    "levels and rates": {"levels": [8], "rates": [3], "burstiness": 2.0},
    "capacity search": {"slos": "e2e:p90:1500ms", "capacity": {"low": 1, "high": 64, "width": 2, "repeats": 2}},
    "prompts from a file": {"levels": [2], "prompt_source": "jsonl", "prompts_jsonl": PROMPTS},
    "workload": {"levels": [2], "workload": "chats"},
}


@pytest.fixture
def login(live_server_asgi, operator, settings, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    return ["--url", live_server_asgi, "--token", tokens.issue(operator)]


def _copied(line: str, tmp_path) -> list[str]:
    """The line as a user runs it: without --wait (nothing measures here), the prompts file where they saved it."""
    argv = shlex.split(line)
    assert argv[:2] == ["panelctl", "bench"] and argv[-1] == "--wait", line
    return [str(tmp_path / "prompts.jsonl") if a == "prompts.jsonl" else a for a in argv[2:-1]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("case", list(BODIES))
def test_the_panelctl_line_of_a_run_makes_a_run_of_the_same_requests(case, login, api, tmp_path):
    (tmp_path / "prompts.jsonl").write_text(PROMPTS)
    if case == "workload":
        made = api.post("/api/workloads/", {"name": "chats", "kind": "multiturn", "turns": 3, "think_s": 1,
                                                        "input_tokens": 40, "max_tokens": 30}, format="json")
        assert made.status_code == 201, made.json()
    answer = api.post("/api/runs/", {"base_url": URL, "served_model": "kimi", **BODIES[case]}, format="json")
    assert answer.status_code == 202, answer.json()
    first = BenchmarkRun.objects.get(pk=answer.json()["id"])
    line, note = runcommand.panelctl_line(first)
    assert ("prompts.jsonl" in note) == (case == "prompts from a file"), note
    assert cli.main([*login, "bench", *_copied(line, tmp_path)]) == 0, line
    again = BenchmarkRun.objects.exclude(pk=first.pk).get()
    assert (again.base_url, again.served_model) == (first.base_url, first.served_model)
    assert again.params == first.params, line
    # and the line of the run it made is the same line
    assert runcommand.panelctl_line(again)[0] == line


@pytest.mark.django_db(transaction=True)
def test_the_panelctl_line_of_a_deployments_run_names_the_deployment(login, api, tmp_path, client, operator):
    d = DeploymentFactory(status="ready", name="kimi-k2-5-gpu-01")
    answer = api.post("/api/runs/", {"deployment": d.pk, "levels": [1, 64], "seed": 3}, format="json")
    assert answer.status_code == 202, answer.json()
    first = BenchmarkRun.objects.get(pk=answer.json()["id"])
    line, _ = runcommand.panelctl_line(first)
    assert line.startswith("panelctl bench kimi-k2-5-gpu-01 --concurrency 1,64 ") and "--seed 3" in line
    BenchmarkRun.objects.filter(pk=first.pk).update(status="done", finished=timezone.now())  # one run at a time
    assert cli.main([*login, "bench", *_copied(line, tmp_path)]) == 0, line
    again = BenchmarkRun.objects.exclude(pk=first.pk).get()
    assert again.deployment_id == d.pk and again.params == first.params
    # The run page and the API show the same line, to copy.
    client.force_login(operator)
    page = client.get(reverse("run-detail", args=[first.pk]))
    assert page.status_code == 200 and html.escape(line) in page.content.decode()
    assert api.get(f"/api/runs/{first.pk}/").json()["commands"]["panelctl"] == line


@pytest.mark.django_db
def test_vllm_bench_lines_exist_for_random_prompts_only_and_say_why_not(api, settings, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    for case, has_lines in (("defaults", True), ("rates and SLOs", True), ("every setting", False),
                            ("capacity search", False), ("prompts from a file", False)):
        answer = api.post("/api/runs/", {"base_url": URL, "served_model": "kimi", **BODIES[case]},
                                      format="json")
        lines, note = runcommand.vllm_bench_lines(BenchmarkRun.objects.get(pk=answer.json()["id"]))
        assert bool(lines) == has_lines and note, (case, note)
    run = BenchmarkRun.objects.get(params__seed=7)
    lines, _ = runcommand.vllm_bench_lines(run)
    assert len(lines) == 2  # one per rate
    assert all("--request-rate" in line and "--ramp-up-strategy linear" in line for line in lines)


@pytest.mark.django_db
def test_a_run_whose_params_predate_a_setting_or_whose_deployment_is_gone_still_has_its_commands_or_says_why():
    old = BenchmarkRun.objects.create(base_url=URL, served_model="kimi", params={"levels": [4], "rates": [2.0]})
    line, _ = runcommand.panelctl_line(old)  # no arrival, seed or lengths in its params: the runner's defaults
    assert line == f"panelctl bench {URL} --model kimi --concurrency 4 --rate 2 --seed 0 --wait"
    assert len(runcommand.vllm_bench_lines(old)[0]) == 2
    orphan = BenchmarkRun.objects.create(params={"levels": [1]})
    assert runcommand.commands(orphan) == {
        "panelctl": "", "panelctl_note": "The deployment this run measured is deleted: a new run needs a deployment "
        "or a URL.", "vllm": [], "vllm_note": "The deployment this run measured is deleted."}
