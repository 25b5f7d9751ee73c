"""Studies pick a winner per level: a study whose variants cross over names the crossover (only where the
intervals separate them), and apply takes the winner for a chosen level."""
import random

import pytest
from django.utils import timezone

from benchmarks import studies, studylevels
from benchmarks.models import BenchmarkPoint, BenchmarkRun, Study
from deployments.models import Deployment
from panelctl import cli
from plumbing import tokens
from tests.benchmarks.test_studies import comes_up, current, d, step  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db
WORKLOAD = {"levels": [1, 4, 16], "max_tokens": 16, "requests_per_user": 1, "min_requests": 4}
VARIANTS = [{"name": "few seqs", "engine_args": {"max-num-seqs": 2}, "env": {}},
            {"name": "many seqs", "engine_args": {"max-num-seqs": 64}, "env": {}}]


def measured(run, speeds: dict, seed: int):
    """Each level done with its per-request samples; `speeds` maps the level to the variant's output tok/s."""
    rng = random.Random(seed)
    for c, tok_s in speeds.items():
        e2e = [16_000 * c / tok_s * (1 + rng.uniform(-0.02, 0.02)) for _ in range(8)]
        BenchmarkPoint.objects.create(run=run, concurrency=c, output_throughput=tok_s, tok_s_per_user=tok_s / c,
                                      ttft_ms={"median": 10.0, "p95": 12.0}, tpot_ms={"median": 1.0},
                                      samples={"tok_s": [tok_s / c] * 8, "ttft_ms": [10.0] * 8, "e2e_ms": e2e})
    now = timezone.now()
    BenchmarkRun.objects.filter(pk=run.pk).update(status="done", started=now, finished=now)


def run_study(d, speeds, workload=WORKLOAD, measure=measured):  # noqa: F811 - the fixture's deployment
    """A study of the two variants played to its end; speeds: variant name -> level -> output tok/s, each trial's
    levels recorded by measure(run, speeds, seed)."""
    study = studies.study_create(deployment=d, variants=VARIANTS, workload=workload, repeats=3)
    for _ in range(200):
        study = step(study)
        if study.status != "running":
            break
        trial = current(study)
        if trial and trial.status == "deploying" and Deployment.objects.get(pk=d.pk).status == "queued":
            comes_up(d)
        elif trial and trial.status == "benchmarking":
            measure(trial.run, speeds[trial.variant.name], seed=trial.pk)
    study.refresh_from_db()
    return study


def test_a_study_whose_variants_cross_over_gives_a_winner_per_level(d):  # noqa: F811
    speeds = {"baseline": {1: 100.0, 4: 300.0, 16: 500.0},
              "few seqs": {1: 160.0, 4: 420.0, 16: 520.0},  # best below c=16
              "many seqs": {1: 110.0, 4: 330.0, 16: 900.0}}  # best from c=16
    study = run_study(d, speeds)
    per_level = study.results["per_level"]
    names = {item["level"]: item["name"] for item in per_level["levels"]}
    assert names == {1: "few seqs", 4: "few seqs", 16: "many seqs"}
    assert per_level["crossover"] == "The winner changes with the load: few seqs below c=16, many seqs from c=16."
    assert studylevels.winner_at(study.results, 16) == study.variants.get(name="many seqs").pk
    # The Pareto view per level: at each level only the variant faster there is unbeaten by the others.
    level_front = {(p["level"], p["name"]) for p in study.results["pareto"] if p["level_front"]}
    assert level_front == {(1, "few seqs"), (4, "few seqs"), (16, "many seqs")}


def test_a_crossover_the_intervals_do_not_support_is_not_claimed(d):  # noqa: F811
    speeds = {"baseline": {1: 100.0, 4: 300.0, 16: 500.0},
              "few seqs": {1: 160.0, 4: 420.0, 16: 520.0},
              "many seqs": {1: 110.0, 4: 419.0, 16: 900.0}}  # at c=4 within noise of few seqs
    study = run_study(d, speeds)
    per_level = study.results["per_level"]
    assert [item["name"] for item in per_level["levels"]] == ["few seqs", "few seqs", "many seqs"]
    assert per_level["crossover"] == ""
    assert "do not separate few seqs at c=4 and many seqs at c=16" in per_level["note"]


def test_apply_takes_the_winner_for_a_chosen_level(d, api, operator_client):  # noqa: F811
    speeds = {"baseline": {1: 100.0, 4: 300.0, 16: 500.0},
              "few seqs": {1: 160.0, 4: 420.0, 16: 520.0},
              "many seqs": {1: 110.0, 4: 330.0, 16: 900.0}}
    study = run_study(d, speeds)
    Study.objects.filter(pk=study.pk).update(status="done")
    Deployment.objects.filter(pk=d.pk).update(status="ready")  # the study's closing redeploy has ended
    answer = api.post(f"/api/studies/{study.pk}/apply/", {"level": 16}, format="json")
    assert answer.status_code == 202, answer.json()
    assert answer.json()["name"] == "many seqs"
    assert Deployment.objects.get(pk=d.pk).engine_args["max-num-seqs"] == 64
    missing = api.post(f"/api/studies/{study.pk}/apply/", {"level": 8}, format="json")
    assert missing.status_code == 400 and "no winner at concurrency 8" in missing.json()["error"]["message"]
    Deployment.objects.filter(pk=d.pk).update(status="ready")
    page = operator_client.post(f"/benchmarks/studies/{study.pk}/apply/", {"level": "1", "variant": ""})
    assert page.status_code == 302
    assert Deployment.objects.get(pk=d.pk).engine_args["max-num-seqs"] == 2


def test_panelctl_tune_shows_the_winner_per_level_and_applies_one(d, live_server_asgi, operator, capsys):  # noqa: F811
    speeds = {"baseline": {1: 100.0, 4: 300.0, 16: 500.0},
              "few seqs": {1: 160.0, 4: 420.0, 16: 520.0},
              "many seqs": {1: 110.0, 4: 330.0, 16: 900.0}}
    study = run_study(d, speeds)
    Study.objects.filter(pk=study.pk).update(status="done")
    Deployment.objects.filter(pk=d.pk).update(status="ready")
    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    assert cli.main([*login, "tune", "status", str(study.pk)]) == 0
    shown = capsys.readouterr().out
    assert "at c=4: few seqs" in shown and "at c=16: many seqs" in shown
    assert study.results["per_level"]["crossover"] in shown
    assert cli.main([*login, "tune", "apply", str(study.pk), "--level", "16"]) == 0
    assert "Redeploying with many seqs" in capsys.readouterr().out
