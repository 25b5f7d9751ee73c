"""SLOs and capacity searches on runs: the API, the form and panelctl ask for them and refuse what cannot run;
a real capacity search against the known-schedule server stores each round as a rate level with its goodput,
and the run page, the API and the CSV give the answer."""
import csv
import html
import io
from unittest import mock

import pytest
from rest_framework.test import APIClient

from benchmarks import services
from benchmarks.forms import RunForm
from benchmarks.models import BenchmarkRun
from panelctl import cli
from plumbing import tokens
from tests.benchmarks.test_rates import URL, api  # noqa: F401 - an operator's API client, URL allowed
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db


def test_the_api_takes_slos_as_text_or_a_list_and_a_capacity_search_alone(api):
    response = api.post("/api/runs/", {"base_url": URL, "slos": "ttft:p99:2s, itl:p95:50ms",
                                       "capacity": {"low": 1, "high": 33, "width": 1, "repeats": 2}}, format="json")
    assert response.status_code == 202, response.json()
    params = response.json()["params"]
    assert params["slos"] == [{"metric": "ttft", "percentile": 99.0, "max_ms": 2000.0},
                              {"metric": "itl", "percentile": 95.0, "max_ms": 50.0}]
    assert params["capacity"] == {"low": 1.0, "high": 33.0, "width": 1.0, "repeats": 2}
    assert params["levels"] == [] and params["arrival"] == "poisson"  # a search runs rate levels only
    listed = api.post("/api/runs/", {"base_url": URL, "levels": [1], "slos": [
        {"metric": "e2e", "percentile": 90, "max_ms": 500}]}, format="json")
    assert listed.status_code == 202 and listed.json()["params"]["slos"][0]["metric"] == "e2e"


@pytest.mark.parametrize("body, field, says", [
    ({"slos": "tpot:p99:1s"}, "slos", "Cannot read the SLO"),
    ({"slos": [{"metric": "ttft", "percentile": 0, "max_ms": 5}]}, "slos", "above 0 and at most 100"),
    ({"capacity": {"low": 1, "high": 8}}, "slos", "needs SLOs"),
    ({"slos": "ttft:p99:2s", "capacity": {"low": 9, "high": 8}}, "capacity", "below its high one"),
    ({"slos": "ttft:p99:2s", "capacity": {"low": 0, "high": 10_000, "width": 0.01}}, "capacity", "at most 12"),
])
def test_the_api_refuses_slos_and_searches_that_cannot_run(api, body, field, says):
    response = api.post("/api/runs/", {"base_url": URL, **body}, format="json")
    assert response.status_code == 400
    assert says in response.json()["error"]["fields"][field][0]
    assert not BenchmarkRun.objects.exists()


def test_the_form_takes_slos_and_a_capacity_search(settings):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    base = {"base_url": URL, "endpoint": "/v1/chat/completions", "prompt_source": "builtin", "input_tokens": 128,
            "max_tokens": 64, "temperature": 0, "requests_per_user": 4, "levels": "", "rates": ""}
    form = RunForm(data={**base, "slos": "ttft:p99:2s", "capacity_low": "1", "capacity_high": "17", "capacity_width": "1"})
    assert form.is_valid(), form.errors
    params = form.params()
    assert params["capacity"] == {"low": 1.0, "high": 17.0, "width": 1.0, "repeats": 1}
    assert params["slos"][0]["max_ms"] == 2000.0 and params["levels"] == [] and params["rates"] == []
    alone = RunForm(data={**base, "capacity_high": "17"})
    assert not alone.is_valid() and "needs SLOs" in alone.errors["slos"][0]
    assert not RunForm(data={**base, "levels": "1", "slos": "ttft-fast"}).is_valid()


def test_a_real_capacity_search_stores_its_rounds_and_says_the_answer(viewer_client, operator, client):
    """Two slots of 20 ms (10 ms to the first token, one 10 ms gap): 100 requests/s at most. A 1 s TTFT limit
    that only a growing queue breaks; the search's rounds are rate levels whatever their outcome."""
    with SchedServer(ttft_ms=10, gap_ms=10, slots=2) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, name="cap", params={
            **services.DEFAULTS, "levels": [], "rates": [], "max_tokens": 2, "min_requests": 10, "rate_duration_s": 0.3,
            "prompt_source": "builtin", "max_concurrency": 0, "seed": 3, "arrival": "poisson", "burstiness": 1.0,
            "slos": [{"metric": "ttft", "percentile": 90, "max_ms": 1000}],
            "capacity": {"low": 2, "high": 34, "width": 8, "repeats": 1}})
        with mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "done", run.error
    rounds = run.capacity["rounds"]
    points = list(run.points.all())
    assert len(rounds) == 2 and sorted(r["rate"] for r in rounds) == sorted(p.rate for p in points)
    for p in points:
        assert p.kind == "rate" and p.slo["each"][0]["metric"] == "ttft"
        assert p.goodput == pytest.approx(p.slo["good"] / p.duration_s, rel=1e-3)
        assert p.slo["good"] <= p.num_requests
    answer = run.capacity["text"]
    assert answer.startswith(f"The server at {server.base_url} serves") and "p90 TTFT <= 1 s" in answer
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    assert html.escape(answer) in page and 'id="chart-slo"' in page and "Goodput (req/s) / attainment" in page
    api = APIClient()
    api.force_authenticate(operator)
    assert api.get(f"/api/runs/{run.pk}/").json()["capacity"]["text"] == answer
    assert {p["goodput"] for p in api.get(f"/api/runs/{run.pk}/points/").json()} == {p.goodput for p in points}
    rows = list(csv.DictReader(io.StringIO(viewer_client.get(f"/benchmarks/{run.pk}/export.csv").content.decode())))
    assert sorted(float(r["goodput"]) for r in rows) == pytest.approx(sorted(p.goodput for p in points))
    assert {r["slo_met"] for r in rows} <= {"True", "False"}


def test_panelctl_bench_sends_slos_and_a_capacity_search(live_server_asgi, operator, settings, capsys, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    assert cli.main([*login, "bench", URL, "--model", "m", "--slo", "ttft:p99:2s", "--slo", "e2e:p90:10s",
                     "--capacity", "1-65", "--capacity-width", "1"]) == 0
    run = BenchmarkRun.objects.get()
    assert f"Run {run.pk}: capacity search 1-65 req/s." in capsys.readouterr().err
    assert [s["metric"] for s in run.params["slos"]] == ["ttft", "e2e"]
    assert run.params["capacity"]["high"] == 65.0 and run.params["levels"] == []
    assert cli.main([*login, "bench", URL, "--slo", "ttft:p99:2s", "--capacity", "lots"]) == 2
    assert "--capacity takes LOW-HIGH" in capsys.readouterr().err
    assert cli.main([*login, "bench", URL, "--slo", "fast"]) == 2
    assert "Cannot read the SLO" in capsys.readouterr().err
    assert BenchmarkRun.objects.count() == 1
