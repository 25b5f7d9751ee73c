"""Named workloads: created (and refused) through the API and panelctl, taken by runs from the API, the form
and panelctl bench --workload; a real run of one against the known-schedule server stores, per level, the
engine's own prefix-cache hit rate next to what the workload could have reused, and the run page shows both."""
import csv
import io
import json
from unittest import mock

import pytest
from rest_framework.test import APIClient

from benchmarks import services, tasks, workloads
from benchmarks.forms import RunForm
from benchmarks.models import BenchmarkRun, Workload
from panelctl import cli
from plumbing import tokens
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db
URL = "http://10.2.2.3:8000"


def trace_text(n=6):
    return "\n".join(json.dumps({"timestamp": 500 * i, "input_length": 700, "output_length": 5, "hash_ids": [0, 100 + i]})
                     for i in range(n))


@pytest.fixture(autouse=True)
def _queued_not_run(settings, sent_tasks):
    """Runs are created and queued, not executed (a test that executes one calls the service itself)."""
    settings.BENCHMARK_URL_ALLOWLIST = [URL]


def test_an_operator_creates_a_workload_with_its_preview_and_a_viewer_only_reads_it(api, viewer, sent_tasks):
    made = api.post("/api/workloads/", {"name": "chats", "kind": "multiturn", "turns": 4, "think_s": 1.5,
                                        "input_tokens": 50, "max_tokens": 20}, format="json")
    assert made.status_code == 201, made.json()
    body = made.json()
    assert body["settings"] == {"turns": 4, "think_s": 1.5}
    # The preview is the control worker's task, sent once the workload is saved: nothing of it in the request.
    assert body["preview"] == {}
    [task] = sent_tasks.commit().of("benchmarks.workload_preview")
    assert task.args == [body["id"]] and task.queue in (None, "control")
    tasks.workload_preview(*task.args)
    preview = api.get(f"/api/workloads/{body['id']}/").json()["preview"]
    assert preview["prompt_tokens"]["max"] == 4 * 50 + 3 * 20
    assert 0 < preview["prefix_reuse"]["share"] < 1
    reader = APIClient()
    reader.force_authenticate(viewer)
    assert reader.get("/api/workloads/").json()["results"][0]["name"] == "chats"
    assert reader.post("/api/workloads/", {"name": "x", "kind": "prefix", "prefixes": 2, "prefix_tokens": 8},
                       format="json").status_code == 403
    assert reader.delete(f"/api/workloads/{body['id']}/").status_code == 403
    assert api.delete(f"/api/workloads/{body['id']}/").status_code == 204 and not Workload.objects.exists()


@pytest.mark.parametrize("body, field, says", [
    ({"kind": "trace", "file": '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": "x"}'},
     "file", 'line 2: field "input_length"'),
    ({"kind": "sharegpt", "file": '[{"conversations": [{"from": "human", "value": 3}]}]'}, "file",
     'line 1: field "conversations[0].value" must be a string'),
    ({"kind": "trace"}, "file", "Upload the file"),
    ({"kind": "prefix", "prefixes": 0, "prefix_tokens": 8}, "prefixes", "from 1 to 10,000"),
    ({"kind": "multiturn", "turns": 3, "think_s": 601}, "think_s", "from 0 to 600"),
])
def test_a_workload_that_cannot_run_is_refused_naming_the_field(api, body, field, says):
    response = api.post("/api/workloads/", {"name": "bad", **body}, format="json")
    assert response.status_code == 400
    assert says in response.json()["error"]["fields"][field][0]
    assert not Workload.objects.exists()


def test_a_run_takes_a_workload_by_name_and_a_trace_replays_at_its_own_rate(api):
    trace = workloads.workload_create(name="yesterday", kind="trace", values={}, file_text=trace_text())
    response = api.post("/api/runs/", {"base_url": URL, "workload": "yesterday"}, format="json")
    assert response.status_code == 202, response.json()
    params = response.json()["params"]
    assert params["levels"] == [] and params["rates"] == [pytest.approx(workloads.workload_preview(trace.pk)["rate"])] == [2.0]
    assert params["workload_name"] == "yesterday" and "workload" not in params  # its data stays out of the answer
    assert BenchmarkRun.objects.get().params["workload"]["requests"] == trace.spec["requests"]
    chats = workloads.workload_create(name="chats", kind="multiturn", values={"turns": 2, "think_s": 0})
    at_rates = api.post("/api/runs/", {"base_url": URL, "workload": chats.pk, "rates": [4]}, format="json")
    assert at_rates.status_code == 202, at_rates.json()  # conversations start at the rate's arrivals
    assert at_rates.json()["params"]["rates"] == [4.0] and at_rates.json()["params"]["workload_name"] == "chats"
    missing = api.post("/api/runs/", {"base_url": URL, "workload": "nope"}, format="json")
    assert missing.status_code == 400 and "No workload 'nope'" in missing.json()["error"]["fields"]["workload"][0]


def test_the_form_takes_a_workload_and_a_trace_needs_no_levels():
    trace = workloads.workload_create(name="t", kind="trace", values={}, file_text=trace_text())
    base = {"base_url": URL, "endpoint": "/v1/chat/completions", "prompt_source": "random", "input_tokens": 128,
            "max_tokens": 64, "temperature": 0, "requests_per_user": 4, "levels": "", "rates": ""}
    form = RunForm(data={**base, "workload": trace.pk})
    assert form.is_valid(), form.errors
    assert form.params()["rates"] == [2.0] and form.params()["workload"]["kind"] == "trace"
    assert not RunForm(data=base).is_valid()  # without the trace: levels or rates are needed


def test_panelctl_adds_a_workload_and_benches_with_it(live_server_asgi, operator, tmp_path, capsys):
    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    (tmp_path / "trace.jsonl").write_text(trace_text())
    assert cli.main([*login, "workload", "add", "day", "--kind", "trace", "--file", str(tmp_path / "trace.jsonl")]) == 0
    assert "preview being made" in capsys.readouterr().out
    workloads.workload_preview(Workload.objects.get().pk)  # the control worker's task
    assert cli.main([*login, "workloads"]) == 0
    assert "6 requests over 2.5 s (2 req/s at 1x)" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}')
    assert cli.main([*login, "workload", "add", "bad", "--kind", "trace", "--file", str(tmp_path / "bad.jsonl")]) == 2
    assert 'line 1: field "input_length"' in capsys.readouterr().err
    assert cli.main([*login, "bench", URL, "--model", "m", "--workload", "day", "--rate", "4,8"]) == 0
    run = BenchmarkRun.objects.get()
    assert run.params["rates"] == [4.0, 8.0] and run.params["workload_name"] == "day"


def test_a_multi_turn_run_stores_the_engines_hit_rate_beside_what_it_could_reuse(viewer_client):
    chats = workloads.workload_create(name="chats", kind="multiturn", values={"turns": 3, "think_s": 0.01,
                                                                               "input_tokens": 40, "max_tokens": 8})
    with SchedServer(ttft_ms=2, gap_ms=1, prefix_cache=True) as server:
        params = workloads.workload_params(chats, {**services.DEFAULTS, "levels": [2], "min_requests": 6,
                                                   "warmup_per_user": 0, "prompt_source": "random"})
        run = BenchmarkRun.objects.create(base_url=server.base_url, params=params)
        with mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
        counted = sum(server.server.prompt_log)
    run.refresh_from_db()
    assert run.status == "done", run.error
    point = run.points.get()
    cache, reuse = point.server_metrics["prefix_cache"], point.prefix_reuse
    assert cache["queries"] == reuse["prompt_tokens"] == counted
    assert 0 < cache["hits"] <= reuse["reusable_tokens"]
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    assert "Workload <strong>chats</strong> (multiturn: 3 turns" in page
    # The header's prompt source is the workload, not the form's "random, 128 tokens in" it never used.
    assert ('id="prompts">workload <strong>chats</strong> (Multi-turn conversations), 40 tokens per user message '
            '/ 8 out, ignore_eos</dd>') in page
    assert f"{round(100 * cache['hits'] / cache['queries'])} % of {cache['queries']:.0f}" in page
    rows = list(csv.DictReader(io.StringIO(viewer_client.get(f"/benchmarks/{run.pk}/export.csv").content.decode())))
    assert float(rows[0]["prefix_cache_hit_rate"]) == cache["hit_rate"]
    assert float(rows[0]["prefix_reusable_share"]) == reuse["share"]


def test_exports_and_comparisons_show_a_trace_runs_workload_by_its_settings_not_its_data(api):
    from benchmarks import selectors

    workloads.workload_create(name="day", kind="trace", values={}, file_text=trace_text())
    ids = [api.post("/api/runs/", {"base_url": URL, "workload": "day", "rates": [r]}, format="json").json()["id"]
           for r in (2, 4)]
    exported = api.get("/api/runs/export/", {"ids": ",".join(map(str, ids))}).json()
    assert exported[0]["params"]["workload"] == {"kind": "trace", "block_tokens": 512}
    runs = selectors.runs_with_points(ids)
    assert [("params.rates", "2.0", "4.0")] == [d for d in selectors.environment_diff(*runs) if d[0].startswith("params.")]


def study_target():
    """A ready deployment on a node whose engine knows the flags a study varies."""
    from datetime import timedelta

    from django.utils import timezone

    from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory

    node = NodeFactory(name="cpu-01", engine_flags=["--max-num-seqs", "--max-model-len", "--port", "--host"], agent_pid=100)
    copy = ModelCopyFactory(node=node)
    return DeploymentFactory(node=node, model=copy.model, status="ready", engine_args={"max-num-seqs": 16},
                             ready_at=timezone.now() - timedelta(hours=1))


def test_a_study_takes_a_named_workload_for_every_trial(api, sent_tasks):
    from benchmarks.models import Study

    d = study_target()
    workloads.workload_create(name="shared", kind="prefix", values={"prefixes": 4, "prefix_tokens": 64, "input_tokens": 32})
    body = {"deployment": d.pk, "variants": [{"engine_args": {"max-num-seqs": 8}}], "repeats": 2,
            "workload": {"workload": "shared", "levels": [4], "min_requests": 8}}
    created = api.post("/api/studies/", body, format="json")
    assert created.status_code == 202, created.json()
    study = Study.objects.get()
    assert study.workload["workload"] == {"kind": "prefix", "prefixes": 4, "prefix_tokens": 64}
    assert study.workload["input_tokens"] == 32 and study.workload["workload_name"] == "shared"
    assert "workload" not in created.json()["workload"]  # the data stays out of the answer, its name in


def test_the_workloads_page_saves_a_trace_shows_its_preview_and_refuses_a_bad_file(operator_client, viewer):
    from django.core.files.uploadedfile import SimpleUploadedFile
    from django.test import Client

    viewer_client = Client()
    viewer_client.force_login(viewer)

    bad = operator_client.post("/benchmarks/workloads/", {
        "name": "bad", "kind": "trace", "input_tokens": 128, "max_tokens": 128,
        "file": SimpleUploadedFile("t.jsonl", b'{"timestamp": 0, "input_length": 9, "output_length": 1}\n{"timestamp": 1}')})
    assert bad.status_code == 400 and 'line 2: field &quot;input_length&quot;' in bad.content.decode()
    good = operator_client.post("/benchmarks/workloads/", {
        "name": "day", "kind": "trace", "input_tokens": 128, "max_tokens": 128,
        "file": SimpleUploadedFile("t.jsonl", trace_text().encode())})
    assert good.status_code == 302 and Workload.objects.get().kind == "trace"
    workloads.workload_preview(Workload.objects.get().pk)  # the control worker's task
    page = viewer_client.get("/benchmarks/workloads/").content.decode()
    assert "6 requests over 2.5 s: 2.0 req/s at 1x" in page and "New workload" not in page  # viewers only read
    assert viewer_client.post(f"/benchmarks/workloads/{Workload.objects.get().pk}/delete/").status_code == 403
    assert operator_client.post(f"/benchmarks/workloads/{Workload.objects.get().pk}/delete/").status_code == 302
    assert not Workload.objects.exists()


def test_panelctl_says_the_engines_hit_rate_beside_what_the_workload_could_reuse():
    from panelctl.workloads import prefix_line

    point = {"server_metrics": {"prefix_cache": {"queries": 3006.0, "hits": 1152.0, "hit_rate": 0.3832}},
             "prefix_reuse": {"prompt_tokens": 3006, "reusable_tokens": 1488, "share": 0.495}}
    assert prefix_line(point) == "  prefix cache: engine hit 38.3 % of 3,006 prompt tokens; the workload could reuse 49.5 %"
    assert prefix_line({"server_metrics": {}, "prefix_reuse": point["prefix_reuse"]}).startswith(
        "  prefix cache: the engine reports no prefix-cache counters")
    assert prefix_line({"server_metrics": {}, "prefix_reuse": {}}) == ""


def test_the_study_form_takes_a_named_workload(operator_client, sent_tasks):
    from benchmarks.models import Study

    d = study_target()
    chats = workloads.workload_create(name="chats", kind="multiturn", values={"turns": 3, "think_s": 1, "input_tokens": 40})
    form = {"deployment": d.pk, "variants": "max-num-seqs=8", "levels": "2", "max_tokens": 16, "input_tokens": 128,
            "requests_per_user": 1, "named_workload": chats.pk, "repeats": 2, "order": "interleaved",
            "rule": "throughput", "finish_with": "baseline"}
    answer = operator_client.post("/benchmarks/studies/", form)
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    study = Study.objects.get()
    assert study.workload["workload"] == {"kind": "multiturn", "turns": 3, "think_s": 1.0}
    assert study.workload["input_tokens"] == 40 and study.workload["levels"] == [2]
