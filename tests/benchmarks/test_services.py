"""Benchmark runs: validation, routing, environment snapshots, and a real sweep against a server
with a known schedule (tests/schedserver.py) stored level by level."""
from unittest import mock

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from benchmarks import payloads, runner, selectors, services
from benchmarks.models import BenchmarkRun
from plumbing.errors import ServiceError
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory, DeploymentFactory, GpuFactory, NodeFactory
from tests.schedserver import SchedServer

pytestmark = pytest.mark.django_db


@pytest.fixture
def ready():
    node = NodeFactory(name="gpu-01", engine_version="0.32.0")
    GpuFactory(node=node, index=0, name="NVIDIA H200")
    d = DeploymentFactory(node=node, status="ready", port=8123, engine_args={"max-num-seqs": 64, "tensor-parallel-size": 1},
                          env={"NCCL_PROTO": "LL"})
    d.gpus.set(node.gpus.all())
    return d


def test_a_run_on_a_deployment_goes_to_its_node_with_an_environment_snapshot(ready, sent_tasks):
    run = services.run_create(deployment=ready, params={"levels": [1, 8, 128]})
    sent = sent_tasks.commit().one("benchmarks.run_execute")
    assert (sent.args, sent.options) == ([run.pk], {"queue": "node.gpu-01"})
    env = run.environment
    assert env["engine_version"] == "0.32.0" and env["env"] == {"NCCL_PROTO": "LL"}
    assert env["engine_args"]["max-num-seqs"] == 64 and env["gpus"][0]["name"] == "NVIDIA H200"
    assert run.warnings == ["The engine's --max-num-seqs is 64: at concurrency 128 requests queue in the engine, "
                            "so those levels measure queueing too."]


def test_a_run_on_a_url_goes_to_the_control_worker(sent_tasks, settings):
    settings.BENCHMARK_URL_ALLOWLIST = ["http://10.0.0.5:8000"]
    run = services.run_create(base_url="http://10.0.0.5:8000", served_model="m", params={})
    assert sent_tasks.commit().one("benchmarks.run_execute").queue == "control"
    assert run.params["levels"] == list(runner.DEFAULT_LEVELS)


def test_a_deployment_that_is_not_ready_or_already_measured_is_refused(ready, sent_tasks):
    ready.status = "loading"
    ready.save()
    with pytest.raises(ServiceError, match="is loading, not ready"):
        services.run_create(deployment=ready, params={})
    ready.status = "ready"
    ready.save()
    services.run_create(deployment=ready, params={})
    with pytest.raises(ServiceError, match="already measuring") as exc:
        services.run_create(deployment=ready, params={})
    assert exc.value.code == "busy"


def test_a_real_sweep_stores_each_level_with_the_schedules_figures():
    with SchedServer(ttft_ms=40, gap_ms=5, tokens_per_chunk=2, reasoning_tokens=4) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params={
            **services.DEFAULTS, "levels": [1, 4], "max_tokens": 16, "min_requests": 8, "requests_per_user": 2})
        with mock.patch("plumbing.live.publishing.publish", autospec=True) as publish:
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "done", run.error
    points = list(run.points.all())
    assert [p.concurrency for p in points] == [1, 4]
    for p in points:
        # An order, not a timing: the client cannot read a token before the server's 40 ms first write; each request's
        # first content chunk is read on the same stream at or after its first token chunk, and its end after both,
        # so every order statistic keeps that order whatever the host's speed. No gap is asked (a busy host read the
        # reasoning and the first content in one read: TTFT = TTFC = 390.157 ms at the median, streak run 3).
        assert 40 <= p.ttft_ms["median"] <= p.ttfc_ms["median"] <= p.e2e_ms["median"]
        assert p.output_tokens == 16 * p.num_requests and p.reasoning_tokens == 4 * p.num_requests
        assert p.content_tokens == 12 * p.num_requests and p.failed_requests == 0
    assert run.single_stream_tok_s == pytest.approx(points[0].tok_s_per_user)
    kinds = {call.args[1] for call in publish.call_args_list}
    assert {"status", "point.1", "point.4", "tick"} <= kinds
    assert run.ticks and run.served_model  # first model the server lists


def test_a_run_of_repeats_stores_every_repeat_and_each_levels_figures_over_them_as_it_ends():
    with SchedServer(ttft_ms=5, gap_ms=2) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params={
            **services.DEFAULTS, "levels": [2], "max_tokens": 8, "min_requests": 6, "requests_per_user": 1,
            "repeats": 3})
        with mock.patch("plumbing.live.publishing.publish", autospec=True) as publish:
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "done", run.error
    points = list(run.points.all())
    assert [(p.concurrency, p.repeat, p.num_requests) for p in points] == [(2, 0, 6), (2, 1, 6), (2, 2, 6)]
    (row,) = run.over_repeats
    assert (row["label"], row["repeats"]) == ("c=2", 3)
    assert row["figures"]["throughput"]["median"] == sorted(p.output_throughput for p in points)[1]
    assert {"point.2", "point.2/1", "point.2/2"} <= {call.args[1] for call in publish.call_args_list}


def test_a_cancelled_run_keeps_its_finished_levels():
    # Each level takes ~3.3 s (8 rounds of 0.41 s); a cancel lands within ~0.7 s.
    with SchedServer(ttft_ms=10, gap_ms=50) as server:
        run = BenchmarkRun.objects.create(base_url=server.base_url, params={
            **services.DEFAULTS, "levels": [1, 2], "max_tokens": 8, "min_requests": 1, "requests_per_user": 8,
            "warmup_per_user": 0})

        def cancel_after_first(level):
            BenchmarkRun.objects.filter(pk=run.pk).update(cancel_requested=True)

        with mock.patch("plumbing.live.publishing.publish", autospec=True), \
             mock.patch("benchmarks.payloads.send_run_status", autospec=True) as status:
            status.side_effect = lambda r: cancel_after_first(None) if r.points.exists() else None
            services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "cancelled" and [p.concurrency for p in run.points.all()] == [1]


def test_an_unreachable_server_fails_the_run_with_a_clear_message():
    run = BenchmarkRun.objects.create(base_url="http://127.0.0.1:9", served_model="m", params={**services.DEFAULTS, "levels": [1]})
    with mock.patch("plumbing.live.publishing.publish", autospec=True):
        services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "failed" and "connect" in run.error


def test_a_sweep_stopped_at_saturation_says_where_why_and_which_levels_it_skipped():
    run = BenchmarkRun.objects.create(base_url="http://127.0.0.1:9", served_model="m",
                                      params={**services.DEFAULTS, "levels": [1, 2, 4, 8, 16]})
    stopped = runner.SweepResult(levels=[runner.LevelResult(concurrency=c) for c in (1, 2, 4)],
                                 saturated="output throughput 1350 tok/s at concurrency 4 against 1300 at 2")
    with mock.patch("benchmarks.runner.sweep_in_child", autospec=True, return_value=stopped) as sweep, \
         mock.patch("plumbing.live.publishing.publish", autospec=True):
        services.run_execute(run.pk)
    run.refresh_from_db()
    assert run.status == "done" and sweep.call_args.args[0].stop_when_saturated is True
    assert any("Stopped after concurrency 4" in w and "Not run: 8, 16" in w and "1350 tok/s" in w for w in run.warnings)


def test_compare_and_export_show_what_changed(viewer_client, viewer):
    a = BenchmarkRunFactory(environment={"engine_args": {"tensor-parallel-size": 8}, "env": {"NCCL_PROTO": "Simple"}})
    b = BenchmarkRunFactory(environment={"engine_args": {"tensor-parallel-size": 8}, "env": {"NCCL_PROTO": "LL"}})
    BenchmarkPointFactory(run=a, concurrency=1, output_throughput=81.0)
    BenchmarkPointFactory(run=b, concurrency=1, output_throughput=61.0)
    page = viewer_client.get(f"/benchmarks/compare/?runs={a.pk}&runs={b.pk}").content.decode()
    assert "<code>env.NCCL_PROTO</code></td><td>Simple</td><td>LL</td>" in page
    csv_text = viewer_client.get(f"/benchmarks/export.csv?ids={a.pk},{b.pk}").content.decode()
    assert csv_text.splitlines()[0].startswith("run,name,target,concurrency") and ",81.0," in csv_text and ",61.0," in csv_text
    exported = viewer_client.get(f"/benchmarks/{a.pk}/export.json").json()
    assert exported[0]["points"][0]["output_throughput"] == 81.0
    api = APIClient()
    api.force_authenticate(viewer)
    assert api.get(f"/api/runs/export/?ids={a.pk},{b.pk}&as=csv").content.decode() == csv_text  # one export


def test_the_api_starts_compares_and_exports(operator, sent_tasks, settings):
    settings.BENCHMARK_URL_ALLOWLIST = ["http://10.1.1.1:8000", "http://10.1.1.2:8000"]
    api = APIClient()
    api.force_authenticate(operator)
    response = api.post("/api/runs/", {"base_url": "http://10.1.1.1:8000", "levels": [1, 4, 16]}, format="json")
    assert response.status_code == 202 and response.json()["params"]["levels"] == [1, 4, 16]
    bad = api.post("/api/runs/", {"base_url": "http://10.1.1.2:8000", "prompt_source": "jsonl", "prompts_jsonl": "not json"}, format="json")
    assert bad.status_code == 400 and "line 1: not valid JSON" in bad.json()["error"]["fields"]["prompts_jsonl"][0]
    assert api.post("/api/runs/", {"levels": [1]}, format="json").status_code == 400
    run = BenchmarkRun.objects.get()
    assert api.post(f"/api/runs/{run.pk}/cancel/").json()["status"] == "cancelled"
    assert api.get(f"/api/runs/compare/?ids={run.pk}").json()["runs"][0]["id"] == run.pk
    assert api.get(f"/api/runs/export/?ids={run.pk}&as=csv").content.decode().startswith("run,name")


def test_the_form_the_api_and_a_bare_run_start_from_the_load_specs_defaults(operator, sent_tasks, settings):
    settings.BENCHMARK_URL_ALLOWLIST = ["http://10.0.0.8:8000"]
    from benchmarks.api.serializers import RunRequestSerializer
    from benchmarks.forms import RunForm

    spec = runner.LoadSpec(base_url="http://x", model="m")
    form = RunForm()
    for name in ("prompt_source", "ignore_eos", "input_tokens", "max_tokens", "temperature", "requests_per_user",
                 "stop_when_saturated", "repeats"):
        assert form.fields[name].initial == getattr(spec, name), name
    api = RunRequestSerializer(data={"base_url": "http://10.0.0.9:8000"})
    assert api.is_valid(), api.errors
    bare = services.run_create(base_url="http://10.0.0.8:8000", served_model="m", params={})
    for name in services.SPEC_PARAMS:
        if name not in ("prompts", "workload"):  # given, or absent: no default to compare
            assert api.validated_data[name] == bare.params[name] == getattr(spec, name), name
    assert api.validated_data["levels"] == bare.params["levels"] == list(spec.levels)


def gauges(running, waiting, kv):
    return {"num_requests_running": {"max": running, "mean": running}, "num_requests_waiting": {"max": waiting, "mean": 1},
            "kv_cache_usage_perc": {"max": kv, "mean": kv}}


def test_a_queue_is_blamed_on_max_num_seqs_or_the_kv_cache_only_when_their_gauges_show_it(ready):
    run = BenchmarkRunFactory(deployment=ready, environment={"engine_args": {"max-num-seqs": 64}})
    with mock.patch("plumbing.live.publishing.publish", autospec=True):
        # The case this guards against: max-num-seqs 64, 12 waiting, the KV cache at 0 %: neither was the limit.
        services._save_point(run, runner.LevelResult(concurrency=32, server_metrics=gauges(20, 12, 0.0)))
        services._save_point(run, runner.LevelResult(concurrency=128, server_metrics=gauges(64, 64, 0.3)))
    first, second = run.warnings
    assert "12 requests waited" in first and "was the limit" not in first
    assert "at most 20 ran at once of max-num-seqs 64" in first and "at most 0 % used" in first
    assert "max-num-seqs 64 (64 requests ran at once) was the limit" in second and "KV cache" not in second


def test_the_run_page_and_the_api_say_where_the_sweep_saturated(viewer_client, viewer):
    run = BenchmarkRunFactory(status="done", environment={
        "engine_args": {"max-num-seqs": 64, "enforce-eager": True}, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "gpus": [],
        "startup": {"ready_s": 23.4, "totals": {"process": 2.0, "weights": 3.0}}, "engine_command": "vllm serve m"})
    for c, tok_s, e2e in ((1, 700, 180), (8, 4200, 240), (16, 6200, 330), (32, 6300, 650)):
        BenchmarkPointFactory(run=run, concurrency=c, output_throughput=tok_s, e2e_ms={"median": e2e}, num_requests=32)
    api = APIClient()
    api.force_authenticate(viewer)
    saturation = api.get(f"/api/runs/{run.pk}/").json()["saturation"]
    assert saturation["level"] == 16 and saturation["text"].startswith("Saturated at c=16: output throughput 6300 tok/s")
    assert "median latency rose from 330 to 650 ms" in saturation["reason"]
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    assert "Saturated at c=16: " in page
    # The environment in a few short lines, not a Python dict: flags as typed, variables, GPUs, start-up in words.
    assert '<code class="cmdline">--max-num-seqs 64 --enforce-eager</code>' in page
    assert "VLLM_CPU_KVCACHE_SPACE=1" in page and "none (CPU)" in page
    assert "ready in 23.4 s (process 2.0 s, weights 3.0 s)" in page and "{&#x27;" not in page
    assert page.index('id="chart-ticks"') < page.index('id="environment"')  # the charts come first


def test_compared_runs_named_alike_are_told_apart_and_what_changed_is_settings_only(viewer_client):
    env = {"engine_args": {"max-num-seqs": 8}, "startup": {"ready_s": 20.0, "totals": {"weights": 3.0}}}
    a = BenchmarkRunFactory(name="tiny 2026-12-01 10:04", environment=env)
    b = BenchmarkRunFactory(name="tiny 2026-12-01 10:04", environment={
        "engine_args": {"max-num-seqs": 16}, "startup": {"ready_s": 31.0, "totals": {"weights": 9.0}}})
    page = viewer_client.get(f"/benchmarks/compare/?runs={a.pk}&runs={b.pk}").content.decode()
    assert f"#{a.pk} tiny 2026-12-01 10:04 · --max-num-seqs 8" in page
    assert f"#{b.pk} tiny 2026-12-01 10:04 · --max-num-seqs 16" in page
    diff = page[page.index('id="diff"'):]
    assert "engine_args.max-num-seqs" in diff and "startup" not in diff  # a measurement is not a setting
    assert "ready in 31.0 s (weights 9.0 s)" in page  # it is shown, as measured, in the environments table


def test_each_level_records_the_joules_its_gpus_used_and_a_cpu_node_none():
    """NVML's energy counters read at the run's start, every tick and each level's end: a level's joules are the
    counters' rise over its measured window (here a fake counter over two GPUs on a clock of the test's own: the
    meter's moments and the counter agree exactly, however busy the host). Before the first level the GPUs draw
    200 W with the engine idle (its /metrics say so), then 1,000 W: each level is told net of the idle draw too."""
    from types import SimpleNamespace

    clock = SimpleNamespace(t=1000.0)
    idle_until = 1000.0 + settings.BENCH_IDLE_S  # the idle window: the run's first 5 s, on the test's clock
    node = NodeFactory(name="gpu-energy")
    for i in range(2):
        GpuFactory(node=node, index=i, name="NVIDIA H200")
    d = DeploymentFactory(node=node, status="ready", port=9)
    d.gpus.set(node.gpus.all())
    cpu = DeploymentFactory(node=NodeFactory(name="cpu-energy"), status="ready", port=9)

    def sweep(spec, on_level, **kw):
        levels = []
        for c in (1, 4):
            clock.t += 0.3
            level = runner.LevelResult(concurrency=c, duration_s=0.25, output_tokens=100 * c, num_requests=c)
            on_level(level)
            levels.append(level)
        return runner.SweepResult(levels=levels)

    def joules(t):  # 200 W while idle, 1,000 W after
        return 200 * (min(t, idle_until) - 1000.0) + 1000 * max(0.0, t - idle_until)

    def wait(seconds):
        clock.t += seconds

    read = mock.Mock(side_effect=lambda indices: int(joules(clock.t) * 1000))  # in mJ
    idle = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "generation_tokens_total": 42.0}
    for deployment in (d, cpu):
        clock.t = 1000.0
        run = BenchmarkRun.objects.create(deployment=deployment, served_model="m", params={**services.DEFAULTS, "levels": [1, 4]})
        with mock.patch("benchmarks.runner.sweep_in_child", autospec=True, side_effect=sweep), \
             mock.patch("benchmarks.services._engine_key", return_value=""), \
             mock.patch("deployments.host.gpu.energy_mj", read), \
             mock.patch("deployments.host.gpu.time", SimpleNamespace(monotonic=lambda: clock.t)), \
             mock.patch("benchmarks.energy.time", SimpleNamespace(sleep=wait)), \
             mock.patch("benchmarks.energy.vllm.read_metrics", return_value=idle), \
             mock.patch("plumbing.live.publishing.publish", autospec=True):
            services.run_execute(run.pk)
        run.refresh_from_db()
        assert run.status == "done", run.error
        points = {p.concurrency: p for p in run.points.all()}
        if deployment is d:
            assert read.call_args.args[0] == [0, 1]
            assert run.idle_watts == pytest.approx(200.0, abs=0.01) and run.warnings == []
            for c, p in points.items():
                assert p.energy_j == pytest.approx(250.0, abs=0.01) and p.watts_per_gpu == pytest.approx(500.0, abs=0.1)
                assert p.energy_net_j == pytest.approx(250.0 - 200.0 * 0.25, abs=0.01)  # 0.25 s of idle draw less
            assert payloads.RunPoint.of(points[4]).joules_per_token == pytest.approx(250.0 / 400, abs=1e-4)
            assert payloads.RunPoint.of(points[4]).joules_per_token_net == pytest.approx(200.0 / 400, abs=1e-4)
            header, *rows = [selectors.CSV_COLUMNS, *selectors.csv_rows(selectors.runs_with_points([run.pk]))]
            assert [row[header.index("energy_net_j")] for row in rows] == pytest.approx([200.0, 200.0], abs=0.01)
            assert [row[header.index("idle_watts")] for row in rows] == pytest.approx([200.0, 200.0], abs=0.01)
        else:
            assert all(p.energy_j is None and p.watts_per_gpu is None and p.energy_net_j is None for p in points.values())
            assert payloads.RunPoint.of(points[1]).joules_per_token is None and run.idle_watts is None
