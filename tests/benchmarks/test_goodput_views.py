"""Goodput and SLO attainment where runs are read side by side: /metrics gives each level of a deployment's latest
run that carried SLOs its goodput, attainment and whether it held (state, not history), and the compare page shows
them when any compared run carried SLOs; and the energy each level cost, gross and net of idle."""
import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.models import BenchmarkPoint, BenchmarkRun
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory, DeploymentFactory

pytestmark = pytest.mark.django_db
SLOS = [{"metric": "ttft", "percentile": 99.0, "max_ms": 2000.0}]


def slo_level(run, goodput, attainment_pct, met, **fields):
    return BenchmarkPointFactory(run=run, goodput=goodput, slo={"good": 10, "goodput": goodput, "attainment_pct": attainment_pct,
                                                                "met": met, "each": []}, **fields)


def scrape(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.content.decode()) for s in family.samples}


def samples_of(samples: dict, name: str, run) -> dict:
    """level -> value of the run's samples of one family."""
    return {dict(labels)["level"]: v for (n, labels), v in samples.items() if n == name and dict(labels)["run"] == str(run.pk)}


@pytest.fixture
def runs():
    d = DeploymentFactory(status="ready")
    with_slos = BenchmarkRunFactory(deployment=d, status="done", finished=timezone.now(), params={"levels": [4], "slos": SLOS})
    slo_level(with_slos, 3.5, 87.5, False, concurrency=4)
    slo_level(with_slos, 2.0, 100.0, True, kind="rate", rate=2.0, concurrency=0)
    slo_level(with_slos, 1.5, 75.0, False, kind="rate", rate=2.0, concurrency=0, repeat=1)  # a capacity search's repeat
    plain = BenchmarkRunFactory(deployment=DeploymentFactory(status="ready"), status="done", finished=timezone.now(),
                                params={"levels": [8]})
    BenchmarkPointFactory(run=plain, concurrency=8)
    return {"slos": with_slos, "plain": plain}


def test_metrics_give_goodput_and_attainment_per_level_of_a_run_with_slos(viewer_client, runs):
    samples = scrape(viewer_client)
    run = runs["slos"]
    assert samples_of(samples, "panel_benchmark_goodput_requests_per_second", run) == {"4": 3.5, "2/s": 2.0}
    assert samples_of(samples, "panel_benchmark_slo_attainment_ratio", run) == {"4": 0.875, "2/s": 1.0}
    assert samples_of(samples, "panel_benchmark_slo_met", run) == {"4": 0.0, "2/s": 1.0}
    # One sample per level (a repeat of a rate is no second level), and none for a run without SLOs.
    assert samples_of(samples, "panel_benchmark_output_tokens_per_second", run).keys() == {"4", "2/s"}
    assert samples_of(samples, "panel_benchmark_goodput_requests_per_second", runs["plain"]) == {}
    assert samples_of(samples, "panel_benchmark_output_tokens_per_second", runs["plain"]) == {"8": 1000.0}


def test_a_newer_run_replaces_the_older_ones_goodput(viewer_client, runs):
    old = runs["slos"]
    newer = BenchmarkRunFactory(deployment=old.deployment, status="done", finished=timezone.now(),
                                params={"levels": [4], "slos": SLOS})
    slo_level(newer, 5.0, 100.0, True, concurrency=4)
    samples = scrape(viewer_client)
    assert samples_of(samples, "panel_benchmark_goodput_requests_per_second", newer) == {"4": 5.0}
    assert samples_of(samples, "panel_benchmark_goodput_requests_per_second", old) == {}


def test_the_compare_page_shows_goodput_and_attainment_when_a_run_carried_slos(viewer_client, runs):
    page = viewer_client.get(f"/benchmarks/compare/?ids={runs['slos'].pk},{runs['plain'].pk}").content.decode()
    assert 'id="cmp-slo"' in page and "p99 TTFT &lt;= 2 s" in page
    table = page[page.index('id="cmp-slo"'):page.index("</table>", page.index('id="cmp-slo"'))]
    rows = [row for row in table.split("<tr>")[2:]]
    assert len(rows) == 3  # the run with SLOs: c=4, 2 req/s and its repeat; the run without none
    assert ">c=4<" in rows[0] and ">3.50<" in rows[0] and ">87.5 %<" in rows[0] and ">no<" in rows[0]
    assert "2 req/s" in rows[1] and ">2.00<" in rows[1] and ">100.0 %<" in rows[1] and ">yes<" in rows[1]
    assert "(repeat 1)" in rows[2] and ">1.50<" in rows[2]
    without = viewer_client.get(f"/benchmarks/compare/?ids={runs['plain'].pk}").content.decode()
    assert 'id="cmp-slo"' not in without


def test_the_compare_page_shows_joules_per_token_gross_and_net_of_idle_where_measured(viewer_client, runs):
    gpu = runs["plain"]
    BenchmarkRun.objects.filter(pk=gpu.pk).update(idle_watts=400.0)
    BenchmarkPoint.objects.filter(run=gpu).update(energy_j=800.0, energy_net_j=600.0, output_tokens=1000,
                                                  watts_per_gpu=350.0)
    page = viewer_client.get(f"/benchmarks/compare/?ids={runs['slos'].pk},{gpu.pk}").content.decode()
    table = page[page.index('id="cmp-energy"'):page.index("</table>", page.index('id="cmp-energy"'))]
    rows = table.split("<tr>")[2:]
    assert rows and all(">0.800<" in row and ">0.600<" in row and ">400<" in row and ">350<" in row for row in rows)
    assert len(rows) == BenchmarkPoint.objects.filter(run=gpu).count(), "the run without energy has no row"
    assert 'id="cmp-energy"' not in viewer_client.get(f"/benchmarks/compare/?ids={runs['slos'].pk}").content.decode()
