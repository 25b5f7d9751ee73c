"""Rate levels everywhere a study is made and read: its time estimate counts them, its rule can name one
("4/s"), the study form and `panelctl tune start` take rates as a run does, and its CSV tells them apart."""
import csv
import io
import math

import pytest

from benchmarks import services, studyestimate, studyresults
from benchmarks.forms import parse_rates
from benchmarks.models import BenchmarkRun, Study
from benchmarks.studyviews import StudyForm
from panelctl import cli, client, rates, tune
from tests.benchmarks import test_studyrates as rate_study
from tests.benchmarks.test_studies import d, loaded, past_run  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db
RATES = {**services.DEFAULTS, "levels": [1], "rates": [2, 8], "max_tokens": 16, "min_requests": 4,
         "rate_duration_s": 3, "warmup_per_user": 1}


def test_the_estimate_counts_each_rate_levels_requests_and_warm_up_at_its_rate(d):  # noqa: F811
    run = past_run(d, [1], seconds=30.0)
    with_rates, basis = studyestimate.bench_seconds(d, RATES)
    without, _ = studyestimate.bench_seconds(d, {**RATES, "rates": []})
    assert basis == f"levels measured in run {run.pk}"
    point = run.points.get()
    one_request = (point.ttft_ms["median"] + (RATES["max_tokens"] - 1) * point.tpot_ms["median"]) / 1000
    expected = 0.0
    for rate in RATES["rates"]:  # as the runner counts them: max(min_requests, rate x duration), ⌈rate⌉ a second warm
        measured = max(RATES["min_requests"], math.ceil(rate * RATES["rate_duration_s"]))
        warmup = min(measured, RATES["warmup_per_user"] * math.ceil(rate))
        expected += (measured + warmup) / rate + one_request
    assert with_rates - without == pytest.approx(expected, abs=0.1)
    # A study of rates alone is estimated too (it had no concurrency level to model).
    alone, _ = studyestimate.bench_seconds(d, {**RATES, "levels": []})
    overhead = (run.finished - run.started).total_seconds() - studyestimate._modelled([point], run.params)
    assert alone == pytest.approx(expected + overhead, abs=0.1)


def test_a_past_run_with_other_rates_is_not_taken_for_the_same_workload(d):  # noqa: F811
    past_run(d, [1], seconds=12.0)
    BenchmarkRun.objects.filter(deployment=d).update(params={**RATES, "rates": [2]})
    assert studyestimate.bench_seconds(d, {**RATES, "rates": [2]}) == (12.0, "its last run of this workload")
    assert studyestimate.bench_seconds(d, RATES)[1] != "its last run of this workload"
    BenchmarkRun.objects.filter(deployment=d).update(params={k: v for k, v in RATES.items() if k != "rates"})
    assert studyestimate.bench_seconds(d, {**RATES, "rates": []})[1] == "its last run of this workload"


def test_the_api_takes_a_rule_at_a_rate_of_the_workload_and_refuses_other_levels(d, api):  # noqa: F811
    body = {"deployment": d.pk, "variants": [{"engine_args": {"max-num-seqs": 1}}], "repeats": 1,
            "workload": {"levels": [4], "rates": [2, 8], "max_tokens": 16}}
    for level, wrong in (("3/s", "3 req/s is not one of the workload's levels (c=4, 2 req/s, 8 req/s)."),
                         (16, "c=16 is not one of the workload's levels"), ("fast", "A concurrency (16) or a request rate")):
        answer = api.post("/api/studies/preview/", {**body, "rule": {"kind": "throughput", "level": level}}, format="json")
        assert answer.status_code == 400, answer.json()
        assert wrong in str(answer.json()["error"]["fields"]["rule"]), answer.json()
    created = api.post("/api/studies/", {**body, "rule": {"kind": "throughput", "level": "8 req/s"}}, format="json")
    assert created.status_code == 202, created.json()
    assert Study.objects.get(pk=created.json()["id"]).rule["level"] == "8/s"
    assert "at 8 req/s" in created.json()["rule_text"]


def test_a_rule_at_a_rate_judges_the_winner_there(d):  # noqa: F811
    study = rate_study.run_study(d)
    assert study.results["winner"] == study.variants.get(name="few seqs").pk  # the default: at c=4
    for level, name in (("8/s", "many seqs"), ("2/s", "few seqs")):
        study.rule = {"kind": "throughput", "level": level}
        results = studyresults.compute(study, n_boot=500)
        assert results["winner"] == study.variants.get(name=name).pk, results["winner_why"]
        assert f"at {level[:-2]} req/s" in results["rule_text"]


def form_data(d, **changes):  # noqa: F811 - the fixture's deployment
    return {"deployment": d.pk, "variants": "max-num-seqs=1", "levels": "", "rates": "2, 8", "max_tokens": 16,
            "input_tokens": 16, "requests_per_user": 1, "repeats": 1, "order": "interleaved", "rule": "throughput",
            "rule_level": "8/s", "finish_with": "baseline", **changes}


def test_the_study_form_takes_rates_as_the_run_form_does_and_a_rule_at_one(d, operator_client):  # noqa: F811
    form = StudyForm(data=form_data(d))
    assert form.is_valid(), form.errors
    args = form.create_args()
    assert args["workload"]["rates"] == parse_rates("2, 8") and args["workload"]["levels"] == []
    assert args["rule"] == {"kind": "throughput", "level": "8/s"}
    for changes, field in (({"rates": "0"}, "rates"), ({"rates": ""}, "levels"), ({"rule_level": "4/s"}, "rule_level"),
                           ({"rule_level": "4"}, "rule_level"), ({"rule_level": "soon"}, "rule_level")):
        bad = StudyForm(data=form_data(d, **changes))
        assert not bad.is_valid() and field in bad.errors, (changes, bad.errors)
    assert StudyForm(data=form_data(d, rates="", levels="1,4", rule_level="4")).is_valid()
    page = operator_client.get("/benchmarks/studies/").content.decode()
    assert 'name="rates"' in page
    started = operator_client.post("/benchmarks/studies/", form_data(d))
    assert started.status_code == 302
    study = Study.objects.get()
    assert study.workload["rates"] == [2.0, 8.0] and study.rule["level"] == "8/s"


def test_panelctl_tune_start_sends_rates_as_panelctl_bench_does_and_a_rule_at_a_rate(d, api):  # noqa: F811
    class Panel:
        def get(self, path, **params):
            return {"results": [{"id": d.pk}]} if params else {"id": d.pk}

    words = ["tune", "start", d.name, "--variant", "max-num-seqs=1", "--concurrency", "4", "--rate", "2,8",
             "--burstiness", "0.5", "--rule", "throughput:8/s", "--repeats", "1"]
    body = tune._body(Panel(), cli.parser().parse_args(words))
    bench = cli.parser().parse_args(["bench", d.name, "--rate", "2,8", "--burstiness", "0.5"])
    assert {k: body["workload"][k] for k in ("rates", "burstiness")} == {"rates": [2.0, 8.0], "burstiness": 0.5}
    assert {k: body["workload"][k] for k in rates.rate_body(bench)} == rates.rate_body(bench)
    assert body["rule"] == {"kind": "throughput", "level": "8/s"}
    assert tune._rule("ttft:4:500") == {"kind": "throughput_under_ttft", "level": 4, "ttft_p95_ms": 500.0}
    with pytest.raises(client.CliError, match="a rate, 4/s"):
        tune._rule("throughput:fast")
    created = api.post("/api/studies/", body, format="json")
    assert created.status_code == 202, created.json()
    study = Study.objects.get(pk=created.json()["id"])
    assert study.workload["rates"] == [2.0, 8.0] and study.workload["burstiness"] == 0.5 and study.rule["level"] == "8/s"


def test_the_study_csv_tells_rate_levels_from_concurrency_levels(d, viewer_client):  # noqa: F811
    study = rate_study.run_study(d)
    rows = list(csv.DictReader(io.StringIO(viewer_client.get(f"/benchmarks/studies/{study.pk}/export.csv").content.decode())))
    levels = {(row["level_kind"], row["concurrency"], row["rate"]) for row in rows}
    assert levels == {("concurrency", "4", ""), ("rate", "0", "2.0"), ("rate", "0", "8.0")}
    many = study.variants.get(name="many seqs").name
    assert {row["output_throughput"] for row in rows if row["variant"] == many and row["rate"] == "8.0"} == {
        str(rate_study.SPEEDS["many seqs"]["8/s"])}
