"""Studies judge request-rate levels apart from concurrency levels: a winner per rate (named "4/s", shown
"4 req/s"), its own crossover sentence, on the study page, the API and panelctl tune; apply takes a rate level."""
import random

import pytest
from django.utils import timezone

from benchmarks import studies, studylevels
from benchmarks.models import BenchmarkPoint, BenchmarkRun, Study
from deployments.models import Deployment
from panelctl import cli
from plumbing import tokens
from tests.benchmarks import test_studylevels as studylevels_tests
from tests.benchmarks.test_studies import d  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db
WORKLOAD = {"levels": [4], "rates": [2, 8], "max_tokens": 16, "requests_per_user": 1, "min_requests": 4,
            "rate_duration_s": 2}
# Variant -> level -> output tok/s: few seqs best at 2 req/s and at c=4, many seqs at 8 req/s.
SPEEDS = {"baseline": {4: 300.0, "2/s": 100.0, "8/s": 500.0},
          "few seqs": {4: 420.0, "2/s": 160.0, "8/s": 520.0},
          "many seqs": {4: 330.0, "2/s": 110.0, "8/s": 900.0}}


def measured(run, speeds: dict, seed: int):
    """Each level done with its per-request samples (a rate level at rate r has concurrency 0, no cap)."""
    rng = random.Random(seed)
    for level, tok_s in speeds.items():
        kind, rate, c = ("rate", float(level[:-2]), 0) if isinstance(level, str) else ("concurrency", 0.0, level)
        e2e = [16_000 / tok_s * (1 + rng.uniform(-0.02, 0.02)) for _ in range(8)]
        BenchmarkPoint.objects.create(run=run, kind=kind, rate=rate, concurrency=c, output_throughput=tok_s,
                                      tok_s_per_user=tok_s / 4, ttft_ms={"median": 10.0, "p95": 12.0},
                                      tpot_ms={"median": 1.0},
                                      samples={"tok_s": [tok_s / 4] * 8, "ttft_ms": [10.0] * 8, "e2e_ms": e2e})
    now = timezone.now()
    BenchmarkRun.objects.filter(pk=run.pk).update(status="done", started=now, finished=now)


def run_study(d, workload=WORKLOAD, speeds=SPEEDS):  # noqa: F811 - the fixture's deployment
    return studylevels_tests.run_study(d, speeds, workload, measure=measured)


def test_rate_levels_get_their_own_winners_and_crossover_apart_from_concurrency(d):  # noqa: F811
    study = run_study(d)
    per_level = study.results["per_level"]
    got = [(item["kind"], item["level"], item["label"], item["name"]) for item in per_level["levels"]]
    assert got == [("concurrency", 4, "c=4", "few seqs"), ("rate", "2/s", "2 req/s", "few seqs"),
                   ("rate", "8/s", "8 req/s", "many seqs")]
    assert per_level["crossover"] == "The winner changes with the rate: few seqs below 8 req/s, many seqs from 8 req/s."
    assert studylevels.winner_at(study.results, "8/s") == study.variants.get(name="many seqs").pk
    assert studylevels.winner_at(study.results, "2 req/s") == study.variants.get(name="few seqs").pk
    assert studylevels.winner_at(study.results, 8) is None  # c=8 is no level of this study
    assert study.results["levels"] == [4, "2/s", "8/s"]
    live = studies.studyresults.study_live(study)
    assert live["levels"] == [4, "2/s", "8/s"]
    assert {t["points"]["8/s"]["tok_s"] for t in live["trials"] if t["variant"] == study.variants.get(name="many seqs").pk} == {900.0}


def test_a_study_of_rates_only_judges_at_its_highest_rate(d):  # noqa: F811
    workload = {**WORKLOAD, "levels": []}
    speeds = {name: {k: v for k, v in levels.items() if k != 4} for name, levels in SPEEDS.items()}
    study = run_study(d, workload, speeds)
    assert study.results, study.error
    assert study.results["winner"] == study.variants.get(name="many seqs").pk  # at 8 req/s, the highest rate
    assert "at 8 req/s" in study.results["rule_text"]
    assert [item["label"] for item in study.results["per_level"]["levels"]] == ["2 req/s", "8 req/s"]


@pytest.mark.parametrize("text, level", [("16", 16), ("c=16", 16), (16, 16), ("4/s", "4/s"), ("4 req/s", "4/s"),
                                         ("0.5/s", "0.5/s"), ("4.0/s", "4/s"), ("x/s", None), ("0/s", None), ("", None)])
def test_a_level_is_named_by_its_concurrency_or_its_rate(text, level):
    assert studylevels.parse_level(text) == level


def test_the_api_the_page_and_panelctl_apply_the_winner_at_a_rate(d, api, operator_client, live_server_asgi, operator,  # noqa: F811
                                                                   capsys):
    study = run_study(d)
    Study.objects.filter(pk=study.pk).update(status="done")
    Deployment.objects.filter(pk=d.pk).update(status="ready")
    answer = api.post(f"/api/studies/{study.pk}/apply/", {"level": "8/s"}, format="json")
    assert answer.status_code == 202, answer.json()
    assert answer.json()["name"] == "many seqs" and Deployment.objects.get(pk=d.pk).engine_args["max-num-seqs"] == 64
    missing = api.post(f"/api/studies/{study.pk}/apply/", {"level": "3/s"}, format="json")
    assert missing.status_code == 400 and "no winner at 3 req/s" in missing.json()["error"]["message"]
    bad = api.post(f"/api/studies/{study.pk}/apply/", {"level": "fast"}, format="json")
    assert bad.status_code == 400 and "level" in bad.json()["error"]["fields"]
    Deployment.objects.filter(pk=d.pk).update(status="ready")
    page = operator_client.post(f"/benchmarks/studies/{study.pk}/apply/", {"level": "2/s", "variant": ""})
    assert page.status_code == 302
    assert Deployment.objects.get(pk=d.pk).engine_args["max-num-seqs"] == 2
    Deployment.objects.filter(pk=d.pk).update(status="ready")
    shown_page = operator_client.get(f"/benchmarks/studies/{study.pk}/").content.decode()
    assert "rates 2, 8 req/s" in shown_page and '"8/s"' in shown_page  # the page's data names the rate levels
    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    assert cli.main([*login, "tune", "status", str(study.pk)]) == 0
    shown = capsys.readouterr().out
    assert "at 2 req/s: few seqs" in shown and "at 8 req/s: many seqs" in shown and "at c=4: few seqs" in shown
    assert study.results["per_level"]["crossover"] in shown
    assert cli.main([*login, "tune", "apply", str(study.pk), "--level", "8/s"]) == 0
    assert "Redeploying with many seqs" in capsys.readouterr().out
