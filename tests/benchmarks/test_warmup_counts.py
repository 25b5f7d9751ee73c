"""Each level keeps how many warm-up requests it sent before its measured ones (the runner's count), and the
API and the run page show it beside the level's request count."""
import math
from unittest import mock

import pytest
from django.urls import reverse

from benchmarks import services
from benchmarks.models import BenchmarkRun
from benchmarks.runner import arrivals
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db


def test_each_level_stores_its_warm_up_count_and_the_api_and_the_run_page_show_it(api, viewer_client):
    params = {**services.DEFAULTS, "levels": [1, 2], "rates": [20], "max_tokens": 4, "min_requests": 4,
              "requests_per_user": 2, "warmup_per_user": 2, "rate_duration_s": 0.5}
    with SchedServer(ttft_ms=5, gap_ms=1) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params=params)
        with mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "done", run.error
    points = {(p.kind, p.concurrency, p.rate): p for p in run.points.all()}
    rate_measured = max(params["min_requests"], math.ceil(20 * params["rate_duration_s"]))
    expected = {("concurrency", 1, 0.0): 2 * 1, ("concurrency", 2, 0.0): 2 * 2,
                ("rate", 0, 20.0): min(rate_measured, params["warmup_per_user"] * 20)}
    assert {key: p.warmup_requests for key, p in points.items()} == expected
    assert points[("rate", 0, 20.0)].num_requests == rate_measured
    assert expected[("rate", 0, 20.0)] == arrivals.rate_warmup(mock.Mock(**params), 20, rate_measured)
    shown = api.get(f"/api/runs/{run.pk}/points/").json()
    assert sorted(p["warmup_requests"] for p in shown) == sorted(expected.values())
    page = viewer_client.get(reverse("run-detail", args=[run.pk]))
    assert page.status_code == 200
    initial = page.context["initial"]["points"]
    assert sorted((p["num_requests"], p["warmup_requests"]) for p in initial) == sorted(
        (p.num_requests, p.warmup_requests) for p in points.values())
    assert "Requests / warm-up" in page.content.decode()
