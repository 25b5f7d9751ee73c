"""Tuning studies: validation before anything starts, the step-by-step state machine (the node side
is played by setting rows as the plan and the run would), failures, agent restarts, pause, cancel,
apply, and the API's roles. The real engine runs them in tests/e2e/test_study.py."""
import random
from datetime import timedelta

import pytest
from django.db.models import F
from django.utils import timezone
from rest_framework.test import APIClient

from benchmarks import studies, studyestimate, studyresults, studyrounds
from benchmarks.models import BenchmarkPoint, BenchmarkRun, Study, StudyTrial
from deployments.models import Deployment, DeploymentEvent
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
FLAGS = ["--max-num-seqs", "--max-model-len", "--enforce-eager", "--served-model-name", "--port", "--host"]
WORKLOAD = {"levels": [1, 4], "max_tokens": 16, "requests_per_user": 1, "min_requests": 4}


@pytest.fixture
def d(sent_tasks):
    node = NodeFactory(name="cpu-01", engine_flags=FLAGS, agent_pid=100)
    copy = ModelCopyFactory(node=node)
    return DeploymentFactory(node=node, model=copy.model, status="ready", engine_args={"max-num-seqs": 16},
                             env={"VLLM_CPU_KVCACHE_SPACE": "1"}, ready_at=timezone.now() - timedelta(hours=1))


def make(d, variants=None, repeats=2, **kw):
    variants = variants or [{"name": "one seq", "engine_args": {"max-num-seqs": 1}, "env": {}}]
    return studies.study_create(deployment=d, variants=variants, workload=WORKLOAD, repeats=repeats, **kw)


def comes_up(d):
    """The plan on the node: the engine loaded, the API answers, the smoke test ended."""
    now = timezone.now()
    DeploymentEvent.objects.create(deployment=d, step="load", started=now, ended=now,
                                   data={"totals": {"process": 2.0, "weights": 3.0, "smoke_test": 0.5}})
    DeploymentEvent.objects.create(deployment=d, step="smoke_test", started=now, ended=now)
    Deployment.objects.filter(pk=d.pk).update(status="ready", ready_at=now)


def measured(run, tok_s, seed=0):
    """The run on the node: each level done, with per-request samples."""
    rng = random.Random(seed)
    for c in WORKLOAD["levels"]:
        per_request = [tok_s * (1 + rng.uniform(-0.02, 0.02)) for _ in range(8)]
        BenchmarkPoint.objects.create(run=run, concurrency=c, output_throughput=tok_s * c, tok_s_per_user=tok_s,
                                      ttft_ms={"median": 10.0, "p95": 12.0}, tpot_ms={"median": 1000 / tok_s},
                                      samples={"tok_s": per_request, "ttft_ms": [10.0] * 8, "tpot_ms": [1000 / tok_s] * 8,
                                               "e2e_ms": [16_000 / r for r in per_request]})
    now = timezone.now()
    BenchmarkRun.objects.filter(pk=run.pk).update(status="done", started=now, finished=now)


def step(study):
    return studies.study_step(study.pk)


def current(study):
    return study.trials.filter(status__in=StudyTrial.OPEN).select_related("variant").first()


def run_through(study, d, speed):
    """Play the node's side until the study leaves RUNNING; `speed` maps a variant name to its tok/s."""
    for _ in range(100):
        study = step(study)
        if study.status != "running":
            return study
        trial = current(study)
        row = Deployment.objects.get(pk=d.pk)
        if trial and trial.status == "deploying" and row.status == "queued":
            if trial.variant.engine_args.get("max-num-seqs") == "oops":
                Deployment.objects.filter(pk=d.pk).update(status="failed", status_message="The engine exited while "
                                                          "loading: invalid int value: 'oops'", stopped_at=timezone.now())
            else:
                comes_up(d)
        elif trial and trial.status == "benchmarking":
            measured(trial.run, speed[trial.variant.name], seed=trial.pk)
    raise AssertionError("the study did not finish")


def test_a_study_counts_its_trials_and_estimates_from_the_deployments_last_load(d):
    loaded(d, seconds=31.0)
    study = make(d, variants=None, repeats=3)
    assert study.trials.count() == 6 and study.variants.count() == 2
    assert list(study.trials.values_list("variant__position", "repeat")) == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    ready_s, basis = studyestimate.redeploy_seconds(d)
    assert ready_s == 31.0 + studyestimate.STOP_S and basis == "its last load"  # queued to smoke-tested, and a stop
    assert study.estimate_s > 7 * ready_s


def test_a_study_made_before_the_smoke_test_answered_estimates_from_the_load(d):
    """perf/study_verdicts.py: a study made right after ready read 1,295 s (the 120 s guess per redeploy) and took 51 s."""
    loaded(d, seconds=31.0)
    DeploymentEvent.objects.filter(deployment=d, step="smoke_test").update(ended=None)  # still asking
    ready_s, basis = studyestimate.redeploy_seconds(d)
    assert basis == "its last load" and ready_s == 2.0 + studyestimate.STOP_S  # queued to the load's end, and a stop


def test_the_estimate_leaves_out_the_download_of_the_last_plan(d):
    """A redeploy finds the copy on the node: a first deploy's 20-minute download is not part of every trial."""
    loaded(d, seconds=31.0)
    queued = DeploymentEvent.objects.get(deployment=d, step="queued")
    DeploymentEvent.objects.create(deployment=d, step="model", started=queued.started + timedelta(milliseconds=500),
                                   ended=queued.started + timedelta(milliseconds=500, minutes=20))
    DeploymentEvent.objects.filter(deployment=d).exclude(step__in=("queued", "model")).update(
        started=F("started") + timedelta(minutes=20), ended=F("ended") + timedelta(minutes=20))
    ready_s, basis = studyestimate.redeploy_seconds(d)
    assert basis == "its last load" and ready_s == 31.0 + studyestimate.STOP_S


def loaded(d, seconds, stop=False):
    """A plan on the node's timeline: queued, (stop,) load, smoke test ended `seconds` after the request."""
    t0 = timezone.now() - timedelta(minutes=30)
    steps = ["queued"] + (["stop"] if stop else []) + ["load", "smoke_test"]
    for i, name in enumerate(steps):
        DeploymentEvent.objects.create(deployment=d, step=name, started=t0 + timedelta(seconds=i),
                                       ended=t0 + timedelta(seconds=seconds if name == "smoke_test" else i + 1))


def past_run(d, levels, seconds, ttft_ms=50.0, tpot_ms=5.0, max_tokens=128):
    """A finished run on the deployment, its levels measured with these latencies."""
    run = BenchmarkRun.objects.create(deployment=d, status="done", params={**runs_defaults(), "levels": levels,
                                      "max_tokens": max_tokens}, started=timezone.now() - timedelta(seconds=seconds),
                                      finished=timezone.now())
    for c in levels:
        BenchmarkPoint.objects.create(run=run, concurrency=c, num_requests=32, ttft_ms={"median": ttft_ms},
                                      tpot_ms={"median": tpot_ms}, e2e_ms={"median": ttft_ms + 127 * tpot_ms})
    return run


def runs_defaults():
    from benchmarks.services import DEFAULTS

    return dict(DEFAULTS)


def test_the_estimate_models_each_level_from_the_runs_measured_on_the_node(d):
    loaded(d, seconds=30.0, stop=True)
    workload = {**runs_defaults(), **WORKLOAD}  # levels 1 and 4, 16 tokens, at least 4 requests a level
    # The same workload ran before in 12 s: that is the benchmark's time.
    past_run(d, [1, 4], seconds=12.0, max_tokens=16).params.update(WORKLOAD)
    BenchmarkRun.objects.filter(deployment=d).update(params={**workload})
    est = studyestimate.study_estimate(d, 4, workload)
    assert est["benchmark_s"] == 12.0 and est["ready_s"] == 30.0 and "its last run of this workload" in est["basis"]
    assert est["estimate_s"] == pytest.approx(4 * (30.0 + 12.0 + studyestimate.TRIAL_OVERHEAD_S) + 30.0)
    # Another workload: each level from the measured one nearest it. At c=1, 5 requests (4 + 1 warm-up) of
    # 50 ms + 15 x 5 ms; at c=4, 8 of them 4 at a time, each (4/1) ** 0.2 longer than measured at 1.
    BenchmarkRun.objects.all().delete()
    run = past_run(d, [1], seconds=30.0)
    own = 33 * (0.05 + 127 * 0.005)  # what that run's level modelled: 32 requests + 1 warm-up
    bench, basis = studyestimate.bench_seconds(d, workload)
    per_request = 0.05 + 15 * 0.005
    assert basis == f"levels measured in run {run.pk}"
    assert bench == pytest.approx(5 * per_request + 8 / 4 * per_request * 4 ** 0.2 + (30.0 - own), abs=0.1)


def test_a_running_study_says_what_is_left_from_its_own_trials(d):
    """Once a trial has ended, the time left comes from what the study's own trials took (the estimate made at
    its start may have had to guess), not from the estimate."""
    study = make(d)  # 4 trials
    Study.objects.filter(pk=study.pk).update(status="running", started=timezone.now())
    study.refresh_from_db()
    trials = list(study.trials.order_by("position"))
    assert studyresults.left_s(study, trials) is None  # nothing measured yet
    now = timezone.now()
    for t, wall in zip(trials[:2], (40.0, 50.0)):
        StudyTrial.objects.filter(pk=t.pk).update(status="done", started=now - timedelta(seconds=100 + wall),
                                                  finished=now - timedelta(seconds=100), ready_s=10.0)
    StudyTrial.objects.filter(pk=trials[2].pk).update(status="benchmarking", started=now - timedelta(seconds=15))
    trials = list(study.trials.order_by("position"))
    # The current trial: 45 - 15 s; the last: 45 s; then the closing redeploy: 10 s.
    assert studyresults.left_s(study, trials, now=now) == 30.0 + 45.0 + 10.0
    assert studyresults.study_live(study)["left_s"] is not None
    Study.objects.filter(pk=study.pk).update(status="done", finished=now)
    study.refresh_from_db()
    assert studyresults.left_s(study, trials) is None


def test_the_estimate_of_a_repeated_study_is_its_past_trials_wall_time(d):
    study = make(d)
    study = run_through(study, d, {"baseline": 100.0, "one seq": 20.0})
    for t in study.trials.all():
        StudyTrial.objects.filter(pk=t.pk).update(started=t.finished - timedelta(seconds=40))
    est = studyestimate.study_estimate(d, 6, study.workload)
    assert est["trial_s"] == 40.0 and "its last 4 trials of this workload" in est["basis"]


def test_one_repeat_measures_but_gives_no_verdict_and_keeps_the_baseline(d):
    preview = studies.study_preview(d, [{"name": "one seq", "engine_args": {"max-num-seqs": 1}, "env": {}}], 1, WORKLOAD)
    assert "no verdict" in preview["warning"]
    study = make(d, repeats=1)
    study = run_through(study, d, {"baseline": 100.0, "one seq": 200.0})
    one = next(r for r in study.results["variants"] if r["name"] == "one seq")
    cmp = one["comparisons"]["throughput@4"]
    assert cmp["verdict"] == "no verdict" and cmp["low"] is None and cmp["why"].startswith("too few repeats to judge: 1 repeat")
    assert one["estimates"]["throughput@4"]["low"] is None
    assert study.results["winner"] == study.variants.get(is_baseline=True).pk
    assert "one seq measured highest, but with too few repeats to judge: 1 repeat" in study.results["winner_why"]


def test_the_results_name_the_rule_in_words_and_give_per_gpu_figures_only_on_gpus(d):
    study = make(d, rule={"kind": "throughput", "level": 4})
    study = run_through(study, d, {"baseline": 100.0, "one seq": 20.0})
    assert study.results["rule_text"].startswith("the highest output tok/s at concurrency 4, if significantly better")
    points = study.results["pareto"]
    assert len(points) == 4 and study.results["gpus"] == 0  # 2 variants x 2 levels, a CPU node
    assert all(p["per_gpu"] is None and p["output_tok_s"] > 0 for p in points)
    assert studyresults.rule_text({"kind": "throughput_under_ttft", "level": 16, "ttft_p95_ms": 500}, [1, 16]) == (
        "the highest output tok/s at concurrency 16 among the variants whose TTFT p95 there is within 500 ms, "
        "if significantly better than the baseline's (else the baseline stays)")


def test_dimensions_make_every_combination_with_env_and_flags_told_apart():
    variants = studies.expand_variants([], {"NCCL_PROTO": ["LL", "Simple"], "--max-num-seqs": [8, 16, 32]})
    assert len(variants) == 6
    assert variants[0] == {"name": "NCCL_PROTO=LL, --max-num-seqs 8", "engine_args": {"max-num-seqs": 8},
                           "env": {"NCCL_PROTO": "LL"}}


def test_random_blocks_run_each_variant_once_per_block():
    order = studyrounds.schedule(4, 3, "random_blocks", seed=7)
    for block in range(3):
        assert sorted(v for v, r in order[block * 4:(block + 1) * 4]) == [0, 1, 2, 3]
        assert {r for _, r in order[block * 4:(block + 1) * 4]} == {block + 1}


def test_mirrored_blocks_give_every_variant_the_same_mean_position_over_two_repeats():
    order = studyrounds.schedule(3, 4, "mirrored")
    assert [v for v, _ in order] == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0]
    assert [r for _, r in order] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    positions = {v: [i for i, (w, _) in enumerate(order) if w == v] for v in range(3)}
    assert len({sum(p) for p in positions.values()}) == 1  # linear drift favours none


def test_a_mirrored_study_of_even_repeats_ends_on_the_baseline_without_a_closing_reload(d):
    study = make(d, order="mirrored")
    study = run_through(study, d, {"baseline": 100.0, "one seq": 20.0})
    assert [t.variant.name for t in study.trials.select_related("variant")] == [
        "baseline", "one seq", "one seq", "baseline"]
    before = Deployment.objects.get(pk=d.pk)
    assert step(study).status == "done"  # the last trial left the baseline running: no reload
    after = Deployment.objects.get(pk=d.pk)
    assert (after.status, after.ready_at, after.engine_args) == ("ready", before.ready_at, {"max-num-seqs": 16})


def test_unknown_flags_and_disallowed_env_are_refused_before_anything_starts(d):
    with pytest.raises(ServiceError, match="unknown engine flag --max-num-seq"):
        make(d, variants=[{"name": "typo", "engine_args": {"max-num-seq": 1}, "env": {}}])
    with pytest.raises(ServiceError, match="not allowed"):
        make(d, variants=[{"name": "env", "engine_args": {}, "env": {"LD_PRELOAD": "x"}}])
    assert not Study.objects.exists() and Deployment.objects.get(pk=d.pk).status == "ready"


def test_a_study_runs_interleaved_trials_judges_them_and_restores_the_baseline(d):
    study = make(d, repeats=3)  # a verdict needs 3 repeats a side
    study = run_through(study, d, {"baseline": 100.0, "one seq": 20.0})
    assert study.status == "finishing"
    trials = list(study.trials.select_related("variant"))
    assert [t.variant.name for t in trials] == ["baseline", "one seq"] * 3
    assert all(t.status == "done" and t.startup["weights"] == 3.0 and t.overhead_s is not None for t in trials)
    one = next(r for r in study.results["variants"] if r["name"] == "one seq")
    assert one["comparisons"]["throughput@4"]["verdict"] == "worse"
    assert one["comparisons"]["ttft_median_ms@4"]["verdict"] == "no significant difference"
    assert study.results["winner"] == study.variants.get(is_baseline=True).pk
    # The last trial left --max-num-seqs 1: the baseline is redeployed, and the study ends once it runs.
    assert Deployment.objects.get(pk=d.pk).engine_args == {"max-num-seqs": 16}
    comes_up(d)
    assert step(study).status == "done"


def test_a_variant_that_fails_to_start_is_recorded_and_the_study_goes_on(d):
    study = make(d, variants=[{"name": "bad", "engine_args": {"max-num-seqs": "oops"}, "env": {}},
                              {"name": "more", "engine_args": {"max-num-seqs": 32}, "env": {}}], repeats=3)
    study = run_through(study, d, {"baseline": 100.0, "more": 150.0})
    bad = study.variants.get(name="bad")
    assert "--max-num-seqs takes a whole number from 1 up, not 'oops'" in bad.failed  # refused before the launch
    assert list(bad.trials.values_list("status", flat=True)) == ["failed", "skipped", "skipped"]
    more = next(r for r in study.results["variants"] if r["name"] == "more")
    assert more["comparisons"]["throughput@4"]["verdict"] == "better"
    assert study.results["winner"] == study.variants.get(name="more").pk


def test_a_run_left_by_a_killed_agent_is_abandoned_and_the_trial_run_again(d):
    study = make(d)
    step(study)
    comes_up(d)
    study = step(study)
    trial = current(study)
    assert trial.status == "benchmarking"
    run_id = trial.run_id
    type(d.node).objects.filter(pk=d.node_id).update(agent_pid=200)  # a new agent registered
    step(study)
    trial.refresh_from_db()
    assert trial.status == "pending" and trial.attempts == 1 and "agent restarted" in trial.error
    assert BenchmarkRun.objects.get(pk=run_id).status == "failed"
    step(study)
    trial.refresh_from_db()
    assert trial.status == "deploying" and trial.attempts == 2


def test_pause_waits_for_the_trial_in_progress_and_resume_continues(d):
    study = make(d)
    step(study)
    studies.study_pause(study)
    comes_up(d)
    study = step(study)  # the trial in progress goes on: its run starts
    measured(current(study).run, 100.0)
    study = step(study)
    assert study.status == "running"
    study = step(study)
    assert study.status == "paused" and current(study).status == "pending"
    with pytest.raises(ServiceError):
        studies.study_pause(study)
    studies.study_resume(study)
    study = step(study)
    assert study.status == "running" and current(study).status == "deploying"


def test_cancel_stops_the_run_in_progress_and_ends_with_the_baseline(d):
    study = make(d)
    step(study)
    comes_up(d)
    study = step(study)
    run = current(study).run
    studies.study_cancel(study)
    study = step(study)
    assert study.status == "finishing" and BenchmarkRun.objects.get(pk=run.pk).cancel_requested
    BenchmarkRun.objects.filter(pk=run.pk).update(status="cancelled", finished=timezone.now())
    step(study)
    step(study)  # baseline settings and ready: nothing to redeploy
    study.refresh_from_db()
    assert study.status == "cancelled"
    assert list(study.trials.values_list("status", flat=True)) == ["failed", "skipped", "skipped", "skipped"]


def test_applying_a_winner_that_sets_an_nccl_debug_variable_asks_for_confirmation(d, api):
    study = make(d, variants=[{"name": "LL", "engine_args": {}, "env": {"NCCL_PROTO": "LL"}}], repeats=1)
    Study.objects.filter(pk=study.pk).update(status="done")
    variant = study.variants.get(name="LL")
    answer = api.post(f"/api/studies/{study.pk}/apply/", {"variant": variant.pk}, format="json")
    assert answer.status_code == 409 and "NCCL_PROTO" in answer.json()["error"]["message"]
    answer = api.post(f"/api/studies/{study.pk}/apply/", {"variant": variant.pk, "confirm_debug": True}, format="json")
    assert answer.status_code == 202
    row = Deployment.objects.get(pk=d.pk)
    assert row.status == "queued" and row.env == {"VLLM_CPU_KVCACHE_SPACE": "1", "NCCL_PROTO": "LL"}


def test_the_api_lets_operators_start_studies_and_viewers_only_watch(d, api):
    body = {"deployment": d.pk, "variants": [{"engine_args": {"max-num-seqs": 1}}], "workload": WORKLOAD, "repeats": 2}
    viewer, operator = APIClient(), api
    viewer.force_authenticate(UserFactory(role="viewer"))
    assert viewer.post("/api/studies/", body, format="json").status_code == 403
    preview = operator.post("/api/studies/preview/", body, format="json")
    assert preview.status_code == 200 and preview.json()["trials"] == 4 and preview.json()["variants"] == 2
    bad = operator.post("/api/studies/", {**body, "variants": [{"engine_args": {"max-num-seq": 1}}]}, format="json")
    assert bad.status_code == 400 and "unknown engine flag" in bad.json()["error"]["message"]
    created = operator.post("/api/studies/", body, format="json")
    assert created.status_code == 202
    shown = viewer.get(f"/api/studies/{created.json()['id']}/").json()
    assert shown["live"]["trials_total"] == 4 and shown["live"]["variants"][1]["name"] == "--max-num-seqs 1"
    assert viewer.post(f"/api/studies/{created.json()['id']}/cancel/").status_code == 403
    again = operator.post("/api/studies/", body, format="json")
    assert again.status_code == 409


def test_a_trial_moves_only_along_its_transitions_and_an_ended_one_stays_ended(d):
    from plumbing.states import InvalidTransition

    study = make(d)
    step(study)
    trial = current(study)
    assert trial.status == "deploying"
    with pytest.raises(InvalidTransition):
        trial.transition(StudyTrial.Status.DONE)  # a trial is done only after its benchmark
    studies._close(trial, StudyTrial.Status.FAILED, "the engine did not start")
    for to in StudyTrial.Status:
        assert not trial.can_transition(to)  # failed, done and skipped trials stay as they ended
    with pytest.raises(InvalidTransition):
        studies._retry(trial, "a late agent restart")  # a stale step cannot reopen it
    assert StudyTrial.objects.get(pk=trial.pk).status == "failed"
    assert set(StudyTrial.TRANSITIONS) == StudyTrial.OPEN and StudyTrial.TERMINAL.isdisjoint(StudyTrial.OPEN)


def test_a_step_that_fails_the_same_way_again_and_again_fails_its_study_with_the_error(d, monkeypatch):
    # A figure the statistics could not take (math.log(0)) failed the study's step every few seconds, forever: the
    # study stayed "running". The driver fails it once the same error came STEP_FAILURES times in a row; another
    # study on the node goes on, and a study whose step fails once and then passes is not failed.
    from benchmarks import studydriver

    other = DeploymentFactory(node=d.node, model=d.model, status="ready", engine_args={"max-num-seqs": 16},
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"}, ready_at=d.ready_at)
    broken, fine = make(d), make(other)
    real = studies.study_step
    failures = {"left": 1}

    def step_once(pk):
        if pk == broken.pk:
            raise ValueError("math domain error")
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("a passing fault")
        return real(pk)

    monkeypatch.setattr(studies, "study_step", step_once)
    for _ in range(studydriver.STEP_FAILURES - 1):
        studydriver.studies_drive(d.node_id)
    assert Study.objects.get(pk=broken.pk).status in Study.DRIVEN  # not yet: it might have been passing
    studydriver.studies_drive(d.node_id)
    broken.refresh_from_db()
    assert broken.status == Study.Status.FAILED
    assert broken.error == ("A step failed 5 times in a row with the same error, so the study stopped: "
                            "ValueError: math domain error")
    assert Study.objects.get(pk=fine.pk).status in Study.DRIVEN


def test_an_adaptive_study_ends_once_every_variant_is_decided(d):
    study = make(d, repeats=3, max_repeats=6)
    assert study.trials.count() == 6  # the first rounds only: more come while a variant is undecided
    study = run_through(study, d, {"baseline": 100.0, "one seq": 20.0})
    assert study.status == "finishing" and study.trials.count() == 6
    adaptive = study.results["adaptive"]
    assert (adaptive["repeats_done"], adaptive["stopped"], adaptive["undecided"]) == (3, "every variant decided", [])
    assert adaptive["z"] == study.results["z"] == studies.studystats.sequential_z(4)  # looks after 3, 4, 5 and 6
    one = next(r for r in study.results["variants"] if r["name"] == "one seq")
    assert one["comparisons"]["throughput@4"]["verdict"] == "worse"


def test_an_adaptive_study_adds_rounds_while_a_variant_is_undecided_and_stops_at_its_cap(d, viewer_client):
    study = make(d, repeats=3, max_repeats=5, order="mirrored")
    study = run_through(study, d, {"baseline": 100.0, "one seq": 100.0})  # no difference: never decided
    trials = list(study.trials.select_related("variant").order_by("position"))
    assert [(t.variant.name, t.repeat) for t in trials] == [
        ("baseline", 1), ("one seq", 1), ("one seq", 2), ("baseline", 2), ("baseline", 3), ("one seq", 3),
        ("one seq", 4), ("baseline", 4), ("baseline", 5), ("one seq", 5)]  # each added round in the study's order
    assert all(t.status == "done" for t in trials)
    adaptive = study.results["adaptive"]
    assert (adaptive["repeats_done"], adaptive["stopped"], adaptive["undecided"]) == (5, "at the cap", ["one seq"])
    one = next(r for r in study.results["variants"] if r["name"] == "one seq")
    assert one["comparisons"]["throughput@4"]["verdict"] == "no significant difference"
    page = viewer_client.get(f"/benchmarks/studies/{study.pk}/").content.decode()
    assert "3 to 5, adaptive: 5 run, stopped at the cap" in page


def test_an_adaptive_studys_cap_is_checked_before_anything_starts(d):
    for repeats, cap in ((3, 2), (2, 5), (3, 13)):  # under its repeats; repeats too few to judge; looks beyond 10
        with pytest.raises(ServiceError) as refused:
            make(d, repeats=repeats, max_repeats=cap)
        assert refused.value.field == "max_repeats" and refused.value.message == (
            f"max_repeats is 0 (not adaptive) or from repeats ({repeats}, at least 3 to judge) to repeats + 9, "
            f"not {cap}.")
    assert make(d, repeats=3, max_repeats=3).max_repeats == 0  # its cap is its repeats: not adaptive
    assert not Study.objects.filter(max_repeats__gt=0).exists()


def test_the_api_starts_an_adaptive_study_and_its_preview_counts_the_trials_at_its_cap(d, api):
    body = {"deployment": d.pk, "variants": [{"engine_args": {"max-num-seqs": 1}}], "workload": WORKLOAD, "repeats": 3,
            "max_repeats": 7}
    preview = api.post("/api/studies/preview/", body, format="json").json()
    assert preview["trials"] == 14 and preview["adaptive"].startswith("Adaptive: judged after 3 repeats")
    refused = api.post("/api/studies/", {**body, "max_repeats": 2}, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["fields"] == {"max_repeats": [
        "max_repeats is 0 (not adaptive) or from repeats (3, at least 3 to judge) to repeats + 9, not 2."]}
    created = api.post("/api/studies/", body, format="json")
    assert created.status_code == 202 and created.json()["max_repeats"] == 7
    assert created.json()["live"]["trials_total"] == 6


def test_an_adaptive_study_whose_baseline_failed_adds_no_round():
    rows = [{"name": "baseline", "is_baseline": True, "failed": "the engine did not start", "comparisons": {}},
            {"name": "v", "is_baseline": False, "failed": "", "comparisons": {}}]
    results = {"rule": {"kind": "throughput"}, "levels": [4], "variants": rows}
    assert studyresults.undecided(results) == []
    rows[0]["failed"] = ""
    assert studyresults.undecided(results) == ["v"]  # no verdict yet: undecided
    rows[1]["comparisons"]["throughput@4"] = {"verdict": "better"}
    assert studyresults.undecided(results) == []
