"""/metrics and the Prometheus service discovery: the exposition, parsed by prometheus_client,
says what the panel's own rows and telemetry say; only viewers and the scrape token read them."""
from datetime import timedelta
from unittest import mock

import pytest
from django.conf import settings
from django.test import override_settings
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.models import BenchmarkRun
from deployments.models import Deployment
from deployments.services import nodes
from plumbing import tokens
from tests.factories import (BenchmarkPointFactory, BenchmarkRunFactory, DeploymentEventFactory, DeploymentFactory,
                             GpuFactory, ModelCopyFactory, NodeFactory)

pytestmark = pytest.mark.django_db
GiB = 2**30


def _sample(t, gpus):
    return {
        "t": t, "nvml_error": "",
        "gpus": [{"index": i, "uuid": f"GPU-{i}", "memory_total": 80 * GiB, "memory_used": used * GiB,
                  "memory_free": (80 - used) * GiB, "util_gpu": util, "util_memory": 7, "temperature_c": 40 + i,
                  "power_w": 300.5 + i, "power_limit_w": 700.0, "sm_clock_mhz": 1980, "pcie_gen": 5, "pcie_width": 16,
                  "processes": []} for i, (used, util) in enumerate(gpus)],
        "disk": {"total": 10**12, "free": 4 * 10**11, "used": 6 * 10**11},
        "host": {"ram_total": 64 * GiB, "ram_available": 32 * GiB, "load1": 0.5},
    }


def scrape(client, **headers) -> dict:
    """{(name, sorted labels): value} of every sample in the answer."""
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content[:300]
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.content.decode()) for s in family.samples}


def value(samples: dict, name: str, **labels):
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.fixture
def fleet(unique):
    node = NodeFactory(name=f"gpu-{unique}", agent_version="1.2.3", disk_free=123 * 10**9, disk_total=900 * 10**9)
    gpus = [GpuFactory(node=node, index=i, uuid=f"GPU-{i}", name="NVIDIA H200") for i in range(2)]
    offline = NodeFactory(name=f"old-{unique}", heartbeat_seconds=5, last_heartbeat=timezone.now() - timedelta(minutes=5))
    sample = _sample(1_700_000_000.5, [(40, 90), (10, 0)])
    nodes.node_sample_record(node.pk, sample, {})
    started = timezone.now() - timedelta(minutes=3)
    ready = DeploymentFactory(node=node, status="ready", started=started, ready_at=started + timedelta(seconds=95),
                              restarts=2)
    ready.gpus.set(gpus)
    loading = DeploymentFactory(node=node, status="loading", load_percent=40.0)
    for step, seconds in (("gpu_memory", 1.5), ("launch", 2.0), ("load", 80.0)):
        DeploymentEventFactory(deployment=ready, step=step, started=started, ended=started + timedelta(seconds=seconds))
    # A restart ran the load step again: the latest one counts.
    DeploymentEventFactory(deployment=ready, step="load", started=started + timedelta(seconds=100),
                           ended=started + timedelta(seconds=160))
    copy = ModelCopyFactory(node=node, state="downloading", bytes_done=5 * GiB, bytes_total=20 * GiB, rate=2e8)
    run = BenchmarkRunFactory(deployment=ready, status="done", single_stream_tok_s=75.0, finished=timezone.now())
    point = BenchmarkPointFactory(run=run, concurrency=8, output_throughput=1234.5, num_requests=64, failed_requests=1,
                                  ttft_ms={"median": 50.0, "p99": 120.0}, itl_ms={"median": 9.0, "p99": 15.0},
                                  energy_j=900.0, energy_net_j=700.0)
    return {"node": node, "offline": offline, "sample": sample, "ready": ready, "loading": loading, "copy": copy,
            "run": run, "point": point}


def test_node_and_gpu_figures_are_the_rows_and_the_last_sample(viewer_client, fleet):
    samples = scrape(viewer_client)
    node, sample = fleet["node"].name, fleet["sample"]
    assert value(samples, "panel_node_online", node=node) == 1
    assert value(samples, "panel_node_online", node=fleet["offline"].name) == 0
    assert value(samples, "panel_node_heartbeat_age_seconds", node=fleet["offline"].name) >= 300
    assert value(samples, "panel_node_model_store_free_bytes", node=node) == fleet["node"].disk_free
    assert value(samples, "panel_node_info", node=node, agent_version="1.2.3", nvml="ok") == 1
    assert value(samples, "panel_node_gpus", node=node) == 2
    assert value(samples, "panel_node_last_sample_timestamp_seconds", node=node) == sample["t"]
    for g in sample["gpus"]:
        labels = {"node": node, "gpu": str(g["index"]), "UUID": g["uuid"], "modelName": "NVIDIA H200"}
        assert value(samples, "panel_gpu_memory_used_bytes", **labels) == g["memory_used"]
        assert value(samples, "panel_gpu_memory_total_bytes", **labels) == g["memory_total"]
        assert value(samples, "panel_gpu_utilization_ratio", **labels) == pytest.approx(g["util_gpu"] / 100)
        assert value(samples, "panel_gpu_temperature_celsius", **labels) == g["temperature_c"]
        assert value(samples, "panel_gpu_power_watts", **labels) == g["power_w"]
        assert value(samples, "panel_gpu_sm_clock_hertz", **labels) == g["sm_clock_mhz"] * 1e6
        assert value(samples, "panel_gpu_pcie_link_generation", **labels) == g["pcie_gen"]
    # The offline node never sent a sample: no GPU readings are made up for it.
    assert not [k for k in samples if k[0].startswith("panel_gpu_") and ("node", fleet["offline"].name) in k[1]]
    # A figure the driver would not give is left out, not reported as 0.
    assert not [k for k in samples if k[0] == "panel_gpu_ecc_double_bit_volatile_errors"]


def test_deployment_state_restarts_phases_and_ready_since(viewer_client, fleet):
    samples = scrape(viewer_client)
    ready, loading = fleet["ready"], fleet["loading"]
    states = {dict(ls)["state"]: v for (n, ls), v in samples.items()
              if n == "panel_deployment_state" and dict(ls)["deployment"] == ready.name}
    assert states == {s: (1 if s == "ready" else 0) for s in Deployment.Status.values}
    assert value(samples, "panel_deployment_state", deployment=loading.name, state="loading") == 1
    assert value(samples, "panel_deployment_restarts", deployment=ready.name, model=str(ready.model)) == 2
    assert value(samples, "panel_deployment_load_phase_seconds", deployment=ready.name, phase="launch") == 2.0
    assert value(samples, "panel_deployment_load_phase_seconds", deployment=ready.name, phase="load") == 60.0
    assert value(samples, "panel_deployment_load_seconds", deployment=ready.name) == 95.0
    assert value(samples, "panel_deployment_ready_since_timestamp_seconds", deployment=ready.name) == ready.ready_at.timestamp()
    assert not [k for k in samples if k[0] == "panel_deployment_ready_since_timestamp_seconds"
                and ("deployment", loading.name) in k[1]]
    assert value(samples, "panel_deployment_load_progress_ratio", deployment=loading.name) == 0.4
    assert value(samples, "panel_deployment_info", deployment=ready.name, gpus="0,1", port=str(ready.port)) == 1


def test_download_and_benchmark_figures(viewer_client, fleet):
    samples = scrape(viewer_client)
    copy, run, point = fleet["copy"], fleet["run"], fleet["point"]
    where = {"node": copy.node.name, "model": str(copy.model)}
    assert value(samples, "panel_download_done_bytes", **where) == copy.bytes_done
    assert value(samples, "panel_download_total_bytes", **where) == copy.bytes_total
    assert value(samples, "panel_download_rate_bytes_per_second", **where) == copy.rate
    assert value(samples, "panel_download_state", state="downloading", **where) == 1
    level = {"run": str(run.pk), "deployment": fleet["ready"].name, "level": "8"}
    assert value(samples, "panel_benchmark_output_tokens_per_second", **level) == point.output_throughput
    assert value(samples, "panel_benchmark_requests", **level) == 64
    assert value(samples, "panel_benchmark_failed_requests", **level) == 1
    assert value(samples, "panel_benchmark_ttft_seconds", stat="p99", **level) == pytest.approx(0.120)
    assert value(samples, "panel_benchmark_itl_seconds", stat="median", **level) == pytest.approx(0.009)
    assert value(samples, "panel_benchmark_energy_joules", **level) == 900.0
    assert value(samples, "panel_benchmark_energy_net_joules", **level) == 700.0
    assert value(samples, "panel_benchmark_single_stream_tokens_per_second", run=str(run.pk)) == 75.0
    assert value(samples, "panel_benchmark_run_info", run=str(run.pk), status="done") == 1


def test_benchmarks_show_state_not_history_so_a_scrape_is_bounded_by_the_fleet(viewer_client, fleet):
    """Each deployment's latest finished run and the runs not ended: older runs stay in the API and CSV."""
    ready, old = fleet["ready"], fleet["run"]

    def runs_shown():
        return sorted(dict(ls)["run"] for (n, ls), v in scrape(viewer_client).items() if n == "panel_benchmark_run_info")

    def benchmark_samples():
        return sum(1 for (n, _), _v in scrape(viewer_client).items() if n.startswith("panel_benchmark_"))

    before = benchmark_samples()
    newer = BenchmarkRunFactory(deployment=ready, status="done", finished=timezone.now())
    BenchmarkPointFactory(run=newer, concurrency=8, output_throughput=2000.0)
    running = BenchmarkRunFactory(deployment=ready, status="running")
    failed = BenchmarkRunFactory(deployment=ready, status="failed", finished=timezone.now())
    shown = runs_shown()
    assert str(newer.pk) in shown and str(running.pk) in shown
    assert str(old.pk) not in shown and str(failed.pk) not in shown
    level = {"run": str(newer.pk), "deployment": ready.name, "level": "8"}
    assert value(scrape(viewer_client), "panel_benchmark_output_tokens_per_second", **level) == 2000.0
    for _ in range(20):  # many more finished runs of the same deployment: the answer does not grow
        BenchmarkPointFactory(run=BenchmarkRunFactory(deployment=ready, status="done", finished=timezone.now()),
                              concurrency=8)
    running.status = "done"
    running.save()
    assert benchmark_samples() <= before + 2  # the running run's info went with it; only the latest done run stays
    assert BenchmarkRun.objects.filter(deployment=ready).count() == 24  # and nothing was deleted


def test_metrics_need_a_viewer_an_api_token_or_the_scrape_token(client, viewer, fleet):
    assert client.get("/metrics").status_code == 401
    token = tokens.issue(viewer)
    assert "panel_node_online" in {n for n, _ in scrape(client, HTTP_AUTHORIZATION=f"Token {token}")}
    with override_settings(METRICS_TOKEN="scrape-secret-1"):
        assert "panel_node_online" in {n for n, _ in scrape(client, HTTP_AUTHORIZATION="Bearer scrape-secret-1")}
        assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
        # The scrape token reads metrics and targets, nothing else.
        assert client.get("/api/prometheus/targets/", HTTP_AUTHORIZATION="Bearer scrape-secret-1").status_code == 200
        assert client.get("/api/nodes/", HTTP_AUTHORIZATION="Bearer scrape-secret-1").status_code in (401, 403)
    # Unset, no bearer token opens anything.
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-1").status_code == 401


def test_service_discovery_lists_each_ready_engine_with_its_labels(viewer_client, fleet):
    response = viewer_client.get("/api/prometheus/targets/")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    ready = fleet["ready"]
    # The engine listens on loopback; its node's gateway serves its /metrics to the scrape key.
    assert response.json() == [{
        "targets": [f"{ready.node.address}:{settings.GATEWAY_PORT}"],
        "labels": {"__metrics_path__": f"/engines/{ready.pk}/metrics", "__scheme__": "http", "node": ready.node.name,
                   "deployment": ready.name,
                   "model": str(ready.model), "gpus": "0,1"},
    }]
    ready.node.gateway_port = 4321  # what the node's gateway reported at its start
    ready.node.save()
    assert viewer_client.get("/api/prometheus/targets/").json()[0]["targets"] == [f"{ready.node.address}:4321"]


def test_the_panels_writer_says_what_prometheus_clients_own_would(fleet):
    from prometheus_client import CollectorRegistry, generate_latest

    from benchmarks.prometheus import BenchmarkCollector
    from controlpanel.metricsview import render
    from deployments.prometheus import DeploymentCollector, DownloadCollector, FleetCollector
    from deployments.models import Node

    fleet["run"].name = 'sweep "b"\\ with\na newline'
    fleet["run"].save()
    nodes = dict(Node.objects.values_list("id", "name"))
    collectors = [FleetCollector(), DeploymentCollector(nodes), DownloadCollector(nodes),
                  BenchmarkCollector({fleet["ready"].pk: fleet["ready"].name})]
    families = [family for collector in collectors for family in collector.collect()]  # one reading for both
    registry = CollectorRegistry(auto_describe=False)
    registry.register(mock.Mock(collect=lambda: families, describe=lambda: []))
    parse = lambda text: sorted((s.name, sorted(s.labels.items()), s.value)  # noqa: E731
                                for f in text_string_to_metric_families(text) for s in f.samples)
    ours = render(families)
    assert parse(ours) == parse(generate_latest(registry).decode())
    assert 'name="sweep \\"b\\"\\\\ with\\na newline"' in ours


def test_a_changed_figure_shows_at_the_next_scrape_and_a_heartbeat_rereads_no_benchmark(viewer_client, fleet):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    level = {"run": str(fleet["run"].pk), "level": "8"}
    assert value(scrape(viewer_client), "panel_benchmark_output_tokens_per_second", **level) == 1234.5
    nodes.node_heartbeat(fleet["node"].pk, disk_total=10**12, disk_free=10**11)
    with CaptureQueriesContext(connection) as queries:
        samples = scrape(viewer_client)
    assert value(samples, "panel_node_model_store_free_bytes", node=fleet["node"].name) == 10**11
    assert not [q for q in queries if "benchmarks_benchmarkpoint" in q["sql"]]  # kept from the last scrape
    fleet["point"].output_throughput = 999.0
    fleet["point"].save()
    fleet["node"].name = "renamed"
    fleet["node"].save()
    samples = scrape(viewer_client)
    assert value(samples, "panel_benchmark_output_tokens_per_second", **level) == 999.0
    assert value(samples, "panel_deployment_restarts", deployment=fleet["ready"].name) == 2
    assert value(samples, "panel_deployment_restarts", node="renamed", deployment=fleet["ready"].name) == 2


def test_without_redis_a_scrape_still_answers_from_the_rows(viewer_client, fleet):
    import redis

    with mock.patch("plumbing.live.snapshots.kept", autospec=True, side_effect=redis.ConnectionError("down")), \
            mock.patch("plumbing.apicache.versions", autospec=True, side_effect=redis.ConnectionError("down")):
        samples = scrape(viewer_client)
    assert value(samples, "panel_node_online", node=fleet["node"].name) == 1
    assert value(samples, "panel_deployment_state", deployment=fleet["ready"].name, state="ready") == 1
    assert not [k for k in samples if k[0].startswith("panel_gpu_")]


def test_a_scrape_can_say_how_long_each_part_took_and_answers_the_same(fleet):
    """perf/metrics_scrape.py profiles /metrics with it."""
    from controlpanel.metricsview import exposition

    def series(text: bytes) -> set:  # ages in seconds move between two scrapes; the series do not
        return {(s.name, tuple(sorted(s.labels.items()))) for f in text_string_to_metric_families(text.decode())
                for s in f.samples}

    timings = {}
    assert series(exposition(timings)) == series(exposition())
    assert set(timings) == {"versions", "node names", "gpus", "deployment names", "live drops", "usage",
                            "DeploymentCollector", "DownloadCollector", "BenchmarkCollector"}
    assert all(seconds >= 0 for seconds in timings.values()) and sum(timings.values()) > 0
