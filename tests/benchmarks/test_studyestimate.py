"""A study's estimate: a first one with nothing measured says it is a guess (preview, study, API, panelctl);
once the node measured a load and a run, it comes from them, and a run measured on a known schedule
(tests/schedserver.py) gives another workload's time from that run's own figures. How close that comes to the
time the schedule makes the workload take is perf/study_verdicts.py's figure (estimate_model_err_pct), not a
test's: the run's figures are the client's clock on a shared machine."""
from unittest import mock

import pytest
from rest_framework.test import APIClient

from benchmarks import services, studies, studyestimate
from benchmarks.models import BenchmarkRun
from panelctl import tune
from tests.benchmarks.test_studies import WORKLOAD, d, loaded, make, past_run  # noqa: F401 (fixtures)
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db


def test_a_first_estimate_with_nothing_measured_says_it_is_a_guess_everywhere_it_is_shown(d, operator):  # noqa: F811
    preview = studies.study_preview(d, [{"name": "one seq", "engine_args": {"max-num-seqs": 1}, "env": {}}], 2,
                                    WORKLOAD)
    assert preview["guess"] and preview["basis"].startswith("a guess: ")
    assert "no load of it recorded yet" in preview["basis"] and "no run or smoke test of it yet" in preview["basis"]
    study = make(d)
    assert study.estimate_basis == preview["basis"]
    api = APIClient()
    api.force_authenticate(operator)
    body = api.get(f"/api/studies/{study.pk}/").json()
    assert body["estimate_basis"].startswith("a guess: ") and body["live"]["estimate_basis"] == body["estimate_basis"]
    shown = tune._lines({**body, "took_s": 60.0})
    assert any(line.startswith("Took 1.0 min (estimated ") and ", a guess: " in line for line in shown), shown


def test_once_a_load_and_a_run_were_measured_the_estimate_names_them_and_is_no_guess(d):  # noqa: F811
    loaded(d, seconds=30.0)
    run = past_run(d, [1, 4], seconds=20.0)
    est = studyestimate.study_estimate(d, 4, {**services.DEFAULTS, **WORKLOAD})
    assert not est["guess"] and "a guess" not in est["basis"]
    assert est["basis"] == f"redeploy: its last load; benchmark: levels measured in run {run.pk}"
    assert est["ready_s"] == 30.0 + studyestimate.STOP_S


def test_a_run_measured_on_a_known_schedule_gives_another_workloads_time_from_its_own_figures(d):  # noqa: F811
    """The deployment's recorded run (level 1, 16 tokens) against a server with a known schedule; the estimate for
    another workload (levels 1 and 2, 48 tokens) is that run's median TTFT and TPOT made into each level's requests,
    as the run's own records say, plus the run's time beyond its requests."""
    measured = {"levels": [1], "max_tokens": 16, "min_requests": 4, "requests_per_user": 4, "warmup_per_user": 0}
    with SchedServer(ttft_ms=30, gap_ms=8) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params={**services.DEFAULTS, **measured})
        with mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "done", run.error
    BenchmarkRun.objects.filter(pk=run.pk).update(deployment=d)  # the deployment's own history
    workload = {**services.DEFAULTS, "levels": [1, 2], "max_tokens": 48, "min_requests": 4, "requests_per_user": 2,
                "warmup_per_user": 1}
    bench, basis = studyestimate.bench_seconds(d, workload)
    assert basis == f"levels measured in run {run.pk}"
    point = run.points.get()
    ttft_s, tpot_s = point.ttft_ms["median"] / 1000, point.tpot_ms["median"] / 1000
    # The recorded run: 4 requests one after another, each its TTFT and 15 tokens more; the rest of its wall time
    # (the child process, prompts) is its overhead, added as it was.
    wall = (run.finished - run.started).total_seconds()
    overhead = max(0.0, wall - 4 * (ttft_s + 15 * tpot_s))
    # The workload: at c=1, 4 requests and 1 warmup one after another; at c=2, 4 and 2 warmup two at a time, each
    # request 48 tokens and slower by 2 ** 0.2 (a request at c streams as at c=1 times c ** CONCURRENCY_EXPONENT).
    request_s = ttft_s + 47 * tpot_s
    expected = 5 * request_s + 6 / 2 * request_s * 2**studyestimate.CONCURRENCY_EXPONENT
    assert bench == pytest.approx(expected + overhead, abs=0.05), (bench, expected, overhead, ttft_s, tpot_s)  # to 0.1 s
