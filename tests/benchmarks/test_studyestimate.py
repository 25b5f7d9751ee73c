"""A study's estimate: a first one with nothing measured says it is a guess (preview, study, API, panelctl);
once the node measured a load and a run, it comes from them, and a run measured on a known schedule
(tests/schedserver.py) predicts another workload within 30 % of what that schedule makes it take."""
import math
import statistics
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


def test_a_run_measured_on_a_known_schedule_predicts_another_workload_within_30_percent(d):  # noqa: F811
    """The deployment's recorded run (level 1, 16 tokens) against a server with a known schedule; the estimate for
    another workload (levels 1 and 2, 48 tokens) against the time that server takes for it by its own record of
    what it delivered: rounds of requests, each TTFT + 47 gaps (it does not slow down with concurrency)."""
    measured = {"levels": [1], "max_tokens": 16, "min_requests": 4, "requests_per_user": 4, "warmup_per_user": 0}
    with SchedServer(ttft_ms=30, gap_ms=8) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params={**services.DEFAULTS, **measured})
        with mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
        # The server's record is the truth (on a loaded host it writes late, and the client sees that too).
        ttft_s, gap_s = statistics.median(server.server.truth_ttft), statistics.median(server.server.truth_itl)
    run.refresh_from_db()
    assert run.status == "done", run.error
    BenchmarkRun.objects.filter(pk=run.pk).update(deployment=d)  # the deployment's own history
    workload = {**services.DEFAULTS, "levels": [1, 2], "max_tokens": 48, "min_requests": 4, "requests_per_user": 2,
                "warmup_per_user": 1}
    bench, basis = studyestimate.bench_seconds(d, workload)
    assert basis == f"levels measured in run {run.pk}"
    # The recorded run's time beyond its requests (the child process, prompts): measured once, added as is.
    points = list(run.points.all())
    overhead = max(0.0, (run.finished - run.started).total_seconds() - studyestimate._modelled(points, {**run.params}))
    per_request = ttft_s + (workload["max_tokens"] - 1) * gap_s
    truth = sum(math.ceil(studyestimate._level_counts(workload, c) / c) * per_request for c in workload["levels"])
    assert bench - overhead == pytest.approx(truth, rel=0.30), (points[0].ttft_ms, points[0].tpot_ms, ttft_s, gap_s)
