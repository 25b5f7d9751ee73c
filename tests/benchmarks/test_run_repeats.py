"""A plain run's repeats (benchmarks/runrepeats.py): asked for through the API (checked), each level's figures as the
median of its repeats with a 95 % interval from 3 repeats, and two runs compared over their repeats with a verdict
only where their intervals separate. The figures are stored points made here: the statistics are exact identities
(medians, the interval holding the mean) and verdicts on differences far larger or far smaller than the spread."""
import random

import pytest

from benchmarks import runrepeats
from benchmarks.studystats import BETTER, NO_VERDICT, SAME
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory

pytestmark = pytest.mark.django_db
URL = "http://10.2.2.9:8000"


def _run(throughputs: list[float], level: int = 4, spread: float = 0.05, seed: int = 0):
    """A run of `len(throughputs)` repeats at `level`, each repeat's requests' end-to-end times about 1 / its rate."""
    run = BenchmarkRunFactory(params={"levels": [level], "repeats": len(throughputs)})
    rng = random.Random(seed)
    for repeat, tok_s in enumerate(throughputs):
        e2e = [400_000 / tok_s * (1 + rng.uniform(-spread, spread)) for _ in range(32)]
        BenchmarkPointFactory(run=run, concurrency=level, repeat=repeat, output_throughput=tok_s,
                              ttft_ms={"median": 50.0 + repeat}, samples={"e2e_ms": e2e})
    run.over_repeats = runrepeats.run_repeats(run)  # as the run's end stores them
    run.save(update_fields=["over_repeats"])
    return run


def test_a_run_asks_for_repeats_through_the_api_and_a_bad_count_is_refused_naming_it(api, settings, sent_tasks):
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    made = api.post("/api/runs/", {"base_url": URL, "levels": [1, 4], "repeats": 3}, format="json")
    assert made.status_code == 202, made.content
    assert made.json()["params"]["repeats"] == 3
    plain = api.post("/api/runs/", {"base_url": URL, "levels": [1]}, format="json").json()
    assert plain["params"]["repeats"] == 1
    for bad in (0, 11, 2.5):
        refused = api.post("/api/runs/", {"base_url": URL, "levels": [1], "repeats": bad}, format="json")
        assert refused.status_code == 400 and "repeats" in refused.json()["error"]["fields"], (bad, refused.content)


def test_each_level_shows_the_median_of_its_repeats_with_an_interval_that_holds_their_mean(viewer_client, api):
    run = _run([1000.0, 1040.0, 980.0, 1010.0])
    BenchmarkPointFactory(run=run, concurrency=8, repeat=0, output_throughput=1500.0)  # once only: no row
    run.over_repeats = runrepeats.run_repeats(run)
    run.save(update_fields=["over_repeats"])
    (row,) = run.over_repeats
    tput = row["figures"]["throughput"]
    assert (row["label"], row["repeats"], tput["repeats"]) == ("c=4", 4, 4)
    assert tput["median"] == 1005.0 and tput["mean"] == pytest.approx(1007.5)
    assert tput["low"] < tput["mean"] < tput["high"] and tput["why"] == ""
    assert row["figures"]["ttft_median_ms"]["median"] == 51.5 and row["figures"]["tpot_median_ms"] is None
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    assert 'id="repeat-figures"' in page and '<tr data-level="c=4">' in page and 'data-f="interval"' in page
    detail = api.get(f"/api/runs/{run.pk}/").json()
    assert detail["over_repeats"][0]["figures"]["throughput"]["median"] == 1005.0


def test_two_repeats_give_medians_but_no_interval_and_one_gives_no_table(viewer_client):
    two = _run([1000.0, 1100.0])
    (row,) = runrepeats.run_repeats(two)
    assert row["figures"]["throughput"]["median"] == 1050.0 and row["figures"]["throughput"]["low"] is None
    assert row["figures"]["throughput"]["why"].startswith("too few repeats to judge: 2 repeats")
    one = _run([1000.0])
    assert runrepeats.run_repeats(one) == []
    assert 'id="repeat-figures"' not in viewer_client.get(f"/benchmarks/{one.pk}/").content.decode()


def test_runs_compared_over_repeats_mark_a_difference_beyond_the_noise_and_not_one_within_it(viewer_client, api):
    base = _run([1000.0, 1020.0, 990.0], seed=1)
    faster = _run([2000.0, 1980.0, 2030.0], seed=2)  # twice the rate, a few % apart between repeats
    same = _run([1010.0, 995.0, 1005.0], seed=3)
    few = _run([2000.0, 2010.0], seed=4)
    verdicts = {r.pk: {row["label"]: row["metrics"]["throughput"]["verdict"]
                       for row in runrepeats.compare_runs(base, r)} for r in (faster, same, few)}
    assert verdicts == {faster.pk: {"c=4": BETTER}, same.pk: {"c=4": SAME}, few.pk: {"c=4": NO_VERDICT}}
    tput = runrepeats.compare_runs(base, faster)[0]["metrics"]["throughput"]
    assert tput["rel"] == pytest.approx(2000 / 1000 - 1)  # of the medians
    assert tput["pair"][0]["high"] < tput["pair"][1]["low"]  # the intervals separate: the mark says so, no more
    ids = f"runs={base.pk}&runs={faster.pk}&runs={same.pk}"
    page = viewer_client.get(f"/benchmarks/compare/?{ids}").content.decode()
    assert 'id="cmp-repeats"' in page and 'data-metric="throughput" data-verdict="better"' in page
    assert 'data-metric="throughput" data-verdict="no significant difference" class="muted"' in page
    data = api.get(f"/api/runs/compare/?ids={base.pk},{faster.pk}").json()
    assert [(r["run"], r["label"], r["metrics"]["throughput"]["verdict"]) for r in data["over_repeats"]] == [
        (faster.pk, "c=4", BETTER)]
