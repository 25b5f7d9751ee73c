"""A capacity search in a real browser: a control-plane Celery worker runs it against the known-schedule server
with a fixed number of slots, and the run page charts each level's TTFT against the SLO's limit and shows the
answer once the search ends."""
import html

import pytest
from playwright.sync_api import expect

from benchmarks import services
from tests.e2e.test_benchmark_page import control_worker  # noqa: F401 - fixture
from tests.schedserver import SchedServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_capacity_search_shows_its_slo_chart_and_answer_live(logged_in_page, control_worker, settings, operator):  # noqa: F811
    page = logged_in_page
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    with SchedServer(ttft_ms=10, gap_ms=10, slots=2) as server:
        settings.BENCHMARK_URL_ALLOWLIST = [server.base_url]
        run = services.run_create(base_url=server.base_url, served_model="sched", user=operator, params={
            "levels": [], "max_tokens": 2, "min_requests": 10, "rate_duration_s": 0.5, "prompt_source": "builtin",
            "slos": [{"metric": "ttft", "percentile": 90, "max_ms": 1000}],
            "capacity": {"low": 2, "high": 34, "width": 8, "repeats": 1}})
        page.goto(f"{page.base_url}/benchmarks/{run.pk}/")
        expect(page.locator("#run-status")).to_have_text("Done", timeout=120_000)
    run.refresh_from_db()
    answer = run.capacity["text"]
    expect(page.locator("#capacity")).to_have_text(answer)  # sent live with the run's last status
    page.reload()
    assert html.escape(answer) in page.content()
    rates = page.evaluate("window.runCharts.slo.data[0]")
    assert sorted(rates) == sorted(r["rate"] for r in run.capacity["rounds"])
    assert page.evaluate("window.runCharts.slo.data[2]") == [1000] * len(rates)  # the limit, at every level
    measured = page.evaluate("window.runCharts.slo.data[1]")
    stored = {p.rate: p.slo["each"][0]["value_ms"] for p in run.points.all()}
    assert measured == pytest.approx([stored[r] for r in rates])
    assert page.locator('#points td[data-f="goodput"]').count() == len(rates)
    assert errors == []
