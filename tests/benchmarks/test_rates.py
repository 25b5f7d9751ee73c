"""Runs of request rates: the API, the form and panelctl ask for them and refuse what cannot run; a real
run against the known-schedule server stores each rate level with its achieved rate and schedule lag,
shown on the run page and in the CSV."""
import csv
import io
from unittest import mock

import pytest
from rest_framework.test import APIClient

from benchmarks import services
from benchmarks.forms import RunForm
from benchmarks.models import BenchmarkPoint, BenchmarkRun
from panelctl import cli
from plumbing import tokens
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db
URL = "http://10.2.2.2:8000"


@pytest.fixture
def api(operator, settings, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    client = APIClient()
    client.force_authenticate(operator)
    return client


def test_the_api_takes_rates_alone_and_keeps_their_arrival_settings(api):
    response = api.post("/api/runs/", {"base_url": URL, "rates": [8, 2, 4], "burstiness": 0.5, "max_concurrency": 16},
                        format="json")
    assert response.status_code == 202, response.json()
    params = response.json()["params"]
    assert params["levels"] == [] and params["rates"] == [2.0, 4.0, 8.0]
    assert (params["arrival"], params["burstiness"], params["max_concurrency"], params["ramp"]) == ("gamma", 0.5, 16, "")
    plain = api.post("/api/runs/", {"base_url": URL, "levels": [1, 4]}, format="json").json()["params"]
    assert "rates" not in plain and "burstiness" not in plain  # a concurrency run's params are as before


@pytest.mark.parametrize("rates, says", [
    ([0], "above 0 (got 0)"), ([2, -1], "above 0 (got -1)"), ([50_000], "more than the 10,000 requests/s"),
])
def test_the_api_refuses_a_rate_that_cannot_run_and_says_why(api, rates, says):
    response = api.post("/api/runs/", {"base_url": URL, "rates": rates}, format="json")
    assert response.status_code == 400
    assert says in response.json()["error"]["fields"]["rates"][0]
    assert not BenchmarkRun.objects.exists()


def test_an_exponential_ramp_needs_a_start_and_a_level_its_request_limit(api, settings):
    bad = api.post("/api/runs/", {"base_url": URL, "rates": [4], "ramp": "exponential"}, format="json")
    assert bad.status_code == 400 and "starts above 0" in bad.json()["error"]["fields"]["ramp_from"][0]
    settings.BENCH_MAX_REQUESTS_PER_LEVEL = 1000
    big = api.post("/api/runs/", {"base_url": URL, "rates": [100], "rate_duration_s": 60}, format="json")
    assert big.status_code == 400 and "would send 6,100 requests (6,000 measured + 100 warm-up)" in big.json()["error"]["message"]


def test_the_form_takes_rates_and_refuses_neither_levels_nor_rates(settings):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    base = {"base_url": URL, "endpoint": "/v1/chat/completions", "prompt_source": "builtin", "input_tokens": 128,
            "max_tokens": 64, "temperature": 0, "requests_per_user": 4, "burstiness": 1, "max_concurrency": 0}
    form = RunForm(data={**base, "levels": "", "rates": "2, 4", "max_concurrency": 8})
    assert form.is_valid(), form.errors
    assert form.params()["levels"] == [] and form.params()["rates"] == [2.0, 4.0]
    assert form.params()["arrival"] == "poisson" and form.params()["max_concurrency"] == 8
    assert not RunForm(data={**base, "levels": "", "rates": ""}).is_valid()
    bare = {k: v for k, v in base.items() if k not in ("burstiness", "max_concurrency")}
    plain = RunForm(data={**bare, "levels": "", "rates": "3"})  # a script that posts only its rates
    assert plain.is_valid(), plain.errors
    assert (plain.params()["burstiness"], plain.params()["max_concurrency"], plain.params()["arrival"]) == (1.0, 0, "poisson")
    zero = RunForm(data={**base, "levels": "1", "rates": "0"})
    assert not zero.is_valid() and "above 0" in zero.errors["rates"][0]


def test_a_real_rate_run_stores_each_level_with_its_rate_and_lag(viewer_client):
    with SchedServer(ttft_ms=5, gap_ms=2) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params={
            **services.DEFAULTS, "levels": [], "rates": [20.0, 40.0], "max_tokens": 4, "min_requests": 10,
            "rate_duration_s": 0.5, "prompt_source": "builtin", "max_concurrency": 4, "seed": 5})
        with mock.patch("plumbing.live.publishing.publish", autospec=True) as publish:
            services.run_execute(run.pk)
        served = server.server.requests_total
    run.refresh_from_db()
    assert run.status == "done", run.error
    points = list(run.points.all())
    assert [(p.kind, p.rate, p.concurrency, p.num_requests) for p in points] == [
        ("rate", 20.0, 4, 10), ("rate", 40.0, 4, 20)]
    # The server counted every request and each level's warm-up before it (⌈rate⌉ a second, at most the level's
    # own count), which the levels' figures leave out.
    assert served == 30 + 10 + 20
    for p in points:
        assert p.achieved_rate > 0 and p.lag_ms["p99"] >= p.lag_ms["p50"] >= 0 and p.failed_requests == 0
    assert {"point.r20", "point.r40"} <= {call.args[1] for call in publish.call_args_list}
    rows = list(csv.DictReader(io.StringIO(viewer_client.get(f"/benchmarks/{run.pk}/export.csv").content.decode())))
    assert [(r["level_kind"], r["rate"]) for r in rows] == [("rate", "20.0"), ("rate", "40.0")]
    assert float(rows[1]["lag_p99_ms"]) == pytest.approx(points[1].lag_ms["p99"])
    assert float(rows[0]["achieved_rate"]) == pytest.approx(points[0].achieved_rate)
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    assert 'axis: "rate"' in page and "Throughput vs request rate" in page and "Sent req/s / lag p99" in page
    assert "20.0, 40.0 req/s, Poisson arrivals, at most 4 in flight" in page


def test_a_rate_point_and_a_concurrency_point_of_one_run_are_two_levels():
    run = BenchmarkRun.objects.create(base_url="http://x", params={"levels": [4], "rates": [4.0]})
    BenchmarkPoint.objects.create(run=run, concurrency=4)
    BenchmarkPoint.objects.create(run=run, kind="rate", rate=4.0, concurrency=4)
    assert [str(p) for p in run.points.all()] == [f"{run} c=4", f"{run} 4 req/s"]


def test_panelctl_bench_sends_rates_and_refuses_what_is_not_one(live_server_asgi, operator, settings, capsys, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    assert cli.main([*login, "bench", URL, "--model", "m", "--rate", "2,4,8", "--burstiness", "0.5",
                     "--max-concurrency", "32"]) == 0
    assert f"Run {BenchmarkRun.objects.get().pk}: rates 2, 4, 8 req/s." in capsys.readouterr().err
    run = BenchmarkRun.objects.get()
    assert run.params["rates"] == [2.0, 4.0, 8.0] and run.params["levels"] == []
    assert (run.params["arrival"], run.params["burstiness"], run.params["max_concurrency"]) == ("gamma", 0.5, 32)
    assert cli.main([*login, "bench", URL, "--rate", "fast"]) == 2
    assert "--rate takes requests per second" in capsys.readouterr().err
    assert cli.main([*login, "bench", URL, "--rate", "0"]) == 2
    assert "above 0" in capsys.readouterr().err
    assert BenchmarkRun.objects.count() == 1
