"""Noise called out (benchmarks/noise.py): compared runs' per-level differences said "within noise" when inside
their own spread (requests resampled), and a run whose load generator sent late says its results are a lower bound.
Seen: single stream 690.9 -> 379.6 tok/s shown with no delta and no caveat; a capacity search "serves 8.38 req/s"
with a send lag p99 of 978 ms at that rate, in a column nobody was told to read."""
import random

import pytest

from benchmarks import noise
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory

pytestmark = pytest.mark.django_db


def _e2e(mean_ms: float, spread: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [mean_ms * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_a_difference_inside_the_runs_own_spread_is_within_noise_and_one_beyond_it_is_named(viewer_client):
    base, same, slower = BenchmarkRunFactory(), BenchmarkRunFactory(), BenchmarkRunFactory()
    # Throughput at a fixed concurrency goes as 1 / the mean request time: 2 % apart with ±40 % per-request noise
    # is inside the spread; 2x slower requests with ±5 % is far beyond it.
    BenchmarkPointFactory(run=base, concurrency=4, output_throughput=1000.0, samples={"e2e_ms": _e2e(400, 0.4, 40, 1)})
    BenchmarkPointFactory(run=same, concurrency=4, output_throughput=980.0, samples={"e2e_ms": _e2e(408, 0.4, 40, 2)})
    BenchmarkPointFactory(run=slower, concurrency=4, output_throughput=500.0, samples={"e2e_ms": _e2e(800, 0.05, 40, 3)})
    BenchmarkPointFactory(run=slower, concurrency=8, output_throughput=900.0)  # a level the first run has not: no row
    rows = noise.level_deltas([base, same, slower])
    tput = {r["run"].pk: r for r in rows if r["metric"] == "output tok/s"}
    assert set(tput) == {same.pk, slower.pk} and all(r["level"] == 4 for r in rows)
    assert (tput[same.pk]["rel_text"], tput[same.pk]["verdict"]) == ("-2.0 %", "within noise")
    assert (tput[slower.pk]["rel_text"], tput[slower.pk]["verdict"]) == ("-50.0 %", "worse, beyond the runs' own spread")
    ttft = next(r for r in rows if r["metric"] == "TTFT median (ms)" and r["run"] == slower)
    assert ttft["verdict"] == "within noise"  # both 50 ms medians: no difference at all
    page = viewer_client.get(f"/benchmarks/compare/?runs={base.pk}&runs={same.pk}&runs={slower.pk}").content.decode()
    assert "<td>within noise</td>" in page and "<td>worse, beyond the runs&#x27; own spread</td>" in page
    assert "One run each cannot measure the host's drift between runs" in page


def test_a_rate_level_sent_late_makes_the_run_say_its_results_are_a_lower_bound(viewer_client):
    run = BenchmarkRunFactory(params={"rates": [2, 8.38], "slos": [{"metric": "ttft", "percentile": 99, "max_ms": 2000}]})
    BenchmarkPointFactory(run=run, kind="rate", rate=2, concurrency=0, lag_ms={"p99": 12.0})  # 2.4 % of its 500 ms gap
    BenchmarkPointFactory(run=run, kind="rate", rate=8.38, concurrency=0, lag_ms={"p99": 978.0})
    said = noise.late_sends(run, list(run.points.all()))
    assert said.startswith("The load generator sent late at 8.38 req/s: send lag p99 up to 978 ms against a mean gap "
                           "of 119 ms between requests (more than 10% of it or of an SLO's limit).")
    assert "lower bound" in said
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    assert 'id="late-sends"' in page and "Results are a lower bound." in page
    on_time = BenchmarkRunFactory(params={"rates": [2]})
    BenchmarkPointFactory(run=on_time, kind="rate", rate=2, concurrency=0, lag_ms={"p99": 12.0})
    assert noise.late_sends(on_time, list(on_time.points.all())) == ""
    assert 'id="late-sends"' not in viewer_client.get(f"/benchmarks/{on_time.pk}/").content.decode()


def test_a_study_of_a_cpu_deployment_has_no_per_gpu_column_even_before_its_results(viewer_client):
    """An "output tok/s per GPU" column showed on a CPU node's study until its results came."""
    from tests.factories import GpuFactory, StudyFactory

    cpu = StudyFactory()
    page = viewer_client.get(f"/benchmarks/studies/{cpu.pk}/").content.decode()
    assert "Output tok/s per GPU</th>" in page and "the deployment's GPUs\" hidden>Output tok/s per GPU" in page
    gpu = StudyFactory()
    GpuFactory(node=gpu.deployment.node, index=0)
    gpu.deployment.gpus.set(gpu.deployment.node.gpus.all())
    assert "the deployment's GPUs\">Output tok/s per GPU" in viewer_client.get(f"/benchmarks/studies/{gpu.pk}/").content.decode()
