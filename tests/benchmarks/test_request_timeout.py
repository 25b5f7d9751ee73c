"""A run's request timeout: set in the form, the API or panelctl bench (checked, the rule named), else each
request's own (runner/spec.request_timeout); a level's timed-out requests are stored, shown by the API and the run
page apart from its other errors."""
from unittest import mock

import pytest
from django.urls import reverse

from benchmarks import services
from benchmarks.forms import RunForm
from benchmarks.models import BenchmarkRun
from panelctl import cli, runs
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db
URL = "http://10.2.2.3:8000"


@pytest.fixture(autouse=True)
def _allowed(settings, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]


def test_the_api_keeps_a_timeout_asked_for_and_none_when_not(api):
    set_ = api.post("/api/runs/", {"base_url": URL, "levels": [1], "request_timeout_s": 1800}, format="json")
    assert set_.status_code == 202, set_.json()
    assert set_.json()["params"]["request_timeout_s"] == 1800.0
    auto = api.post("/api/runs/", {"base_url": URL, "levels": [1]}, format="json").json()["params"]
    assert auto["request_timeout_s"] is None  # each request's own


@pytest.mark.parametrize("value, says", [(0, "above 0"), (-1, "above 0"), (10**8, "at most")])
def test_the_api_and_the_form_refuse_a_timeout_that_cannot_be_and_say_why(api, value, says):
    response = api.post("/api/runs/", {"base_url": URL, "levels": [1], "request_timeout_s": value}, format="json")
    assert response.status_code == 400
    assert says in response.json()["error"]["fields"]["request_timeout_s"][0]
    form = RunForm(data={"base_url": URL, "endpoint": "/v1/chat/completions", "prompt_source": "builtin",
                         "input_tokens": 8, "max_tokens": 8, "temperature": 0, "requests_per_user": 1, "levels": "1",
                         "request_timeout_s": value})
    assert not form.is_valid() and says in form.errors["request_timeout_s"][0]
    assert not BenchmarkRun.objects.exists()


def test_the_form_passes_a_timeout_on_and_leaves_it_out_when_empty():
    base = {"base_url": URL, "endpoint": "/v1/chat/completions", "prompt_source": "builtin", "input_tokens": 8,
            "max_tokens": 8, "temperature": 0, "requests_per_user": 1, "levels": "1"}
    form = RunForm(data={**base, "request_timeout_s": "2400"})
    assert form.is_valid(), form.errors
    assert form.params()["request_timeout_s"] == 2400.0
    empty = RunForm(data=base)
    assert empty.is_valid(), empty.errors
    assert empty.params().get("request_timeout_s") is None


def test_panelctl_bench_sends_request_timeout():
    sent = {}

    class Panel:
        def post(self, path, body, key=None):
            sent.update(body)
            return {"id": 1, "params": {"levels": [1]}, "status": "queued"}

    args = cli.parser().parse_args(["bench", "http://e:8000", "--model", "m", "--concurrency", "1",
                                    "--request-timeout", "3600"])
    runs.cmd_bench(Panel(), args)
    assert sent["request_timeout_s"] == 3600.0
    sent.clear()
    runs.cmd_bench(Panel(), cli.parser().parse_args(["bench", "http://e:8000", "--model", "m", "--concurrency", "1"]))
    assert "request_timeout_s" not in sent  # the panel's default: each request's own


def test_a_level_whose_requests_time_out_stores_and_shows_them_as_timeouts(api, viewer_client):
    params = {**services.DEFAULTS, "levels": [2], "max_tokens": 4, "min_requests": 4, "requests_per_user": 1,
              "warmup_per_user": 0, "prompt_source": "builtin", "request_timeout_s": 0.3}
    with SchedServer(ttft_ms=20_000, gap_ms=1) as server:  # no first token for 20 s; 0.3 s allowed
        run = BenchmarkRun.objects.create(base_url=server.base_url, params=params)
        with mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "failed" and "timed out" in run.error
    point = run.points.get()
    assert (point.num_requests, point.failed_requests, point.timeouts, point.errors) == (4, 4, 4, [])
    shown = api.get(f"/api/runs/{run.pk}/points/").json()
    assert [(p["failed_requests"], p["timeouts"]) for p in shown] == [(4, 4)]
    page = viewer_client.get(reverse("run-detail", args=[run.pk]))
    assert [p["timeouts"] for p in page.context["initial"]["points"]] == [4]
    assert "timed out" in page.content.decode()


def test_panelctl_bench_says_how_many_requests_of_a_level_failed_and_timed_out(capsys):
    point = {"concurrency": 8, "output_throughput": 10.0, "ttft_ms": {"median": 5.0}, "tpot_ms": {}, "tok_s_per_user": 0.0,
             "num_requests": 32, "failed_requests": 5, "timeouts": 4, "errors": ["HTTP 500: boom"]}
    run = {"id": 3, "params": {"levels": [8]}, "status": "done", "warnings": [], "single_stream_tok_s": None, "error": ""}

    class Panel:
        def post(self, path, body, key=None):
            return {**run, "status": "queued"}

        def get(self, path):
            return [point] if path.endswith("points/") else run

    args = cli.parser().parse_args(["bench", "http://e:8000", "--model", "m", "--concurrency", "8", "--wait"])
    assert runs.cmd_bench(Panel(), args) == 0
    assert "5 of 32 failed (4 timed out): HTTP 500: boom" in capsys.readouterr().err
