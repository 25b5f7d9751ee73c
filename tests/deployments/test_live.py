"""Live payloads: each message goes to the same topics with the fields the pages in static/panel/ read."""
from unittest import mock

import pytest

from benchmarks import payloads as benchmark_payloads
from deployments import payloads
from plumbing.live import fleetfeed
from tests.factories import (BenchmarkPointFactory, BenchmarkRunFactory, DeploymentFactory, ModelCopyFactory,
                             NodeFactory)

pytestmark = pytest.mark.django_db


@pytest.fixture
def sent():
    with mock.patch("plumbing.live.publishing.publish", autospec=True) as publish:
        yield publish


def _messages(publish):
    return [(c.args[0], c.args[1], c.args[2], c.kwargs.get("keep", True)) for c in publish.call_args_list]


def test_a_deployments_status_goes_to_its_page_and_its_nodes_page_with_the_same_fields(sent):
    d = DeploymentFactory(status="loading", status_message="", load_phase="weights", load_percent=40.0, pid=7)
    payloads.send_deployment_status(d)
    (t1, k1, data, keep), (t2, k2, same, _) = _messages(sent)
    assert (t1, k1, t2, k2, keep) == (f"deployment:{d.pk}", "status", f"node:{d.node_id}", f"deployment.{d.pk}", True)
    assert data is same and data == {
        "id": d.pk, "name": d.name, "status": "loading", "status_display": "Loading", "message": "",
        "load_phase": "weights", "load_percent": 40.0, "load_detail": {}, "pid": 7, "smoke": {}}


def test_a_timeline_step_and_log_lines_go_to_the_deployment_page(sent):
    d = DeploymentFactory()
    event = d.events.create(step="launch", message="PID 7")
    payloads.send_timeline_step(event)
    payloads.send_log_lines(d.pk, ["a", "b"])
    (topic, kind, step, _), (_, log_kind, log, keep) = _messages(sent)
    assert (topic, kind) == (f"deployment:{d.pk}", f"event.{event.pk}")
    assert step == {"id": event.pk, "step": "launch", "message": "PID 7", "level": "info",
                    "started": event.started.isoformat(), "ended": None, "duration": None}
    assert (log_kind, log, keep) == ("log", {"lines": ["a", "b"]}, False)


def test_engine_figures_and_a_copys_progress_go_to_both_pages(sent):
    node = NodeFactory(name="gpu-04")
    payloads.send_engine_figures(node.pk, payloads.EngineFigures(id=3, name="x", tok_s=12.5, running=1.0, waiting=0.0,
                                                                 kv_cache=0.25))
    copy = ModelCopyFactory(node=node, state="downloading", bytes_done=5, bytes_total=10, rate=1.0,
                            progress={"files": {"a": [5, 10]}, "current_file": "a"})
    payloads.send_copy(copy)
    (t1, k1, figures, _), (t2, k2, _, _), (t3, k3, progress, _), (t4, k4, _, _) = _messages(sent)
    assert (t1, k1, t2, k2) == ("deployment:3", "engine", f"node:{node.pk}", "engine.3")
    assert figures == {"id": 3, "name": "x", "tok_s": 12.5, "running": 1.0, "waiting": 0.0, "kv_cache": 0.25,
                       "ttft_p95_s": None, "error_share": None, "refused": 0, "window_requests": 0, "window_s": 0.0, "at": 0.0}
    assert (t3, k3, t4, k4) == (f"model:{copy.model_id}", f"copy.{copy.pk}", f"node:{node.pk}", f"copy.{copy.pk}")
    assert progress == {"id": copy.pk, "model": copy.model_id, "node": node.pk, "node_name": "gpu-04",
                        "state": "downloading", "bytes_done": 5, "bytes_total": 10, "rate": 1.0, "seconds_left": 5.0,
                        "files": {"a": [5, 10]}, "current_file": "a", "error": "", "path": copy.path,
                        "retries": 0, "retry": None}


def test_a_node_sample_with_a_missing_or_unknown_key_is_refused_before_it_reaches_a_browser(sent):
    sample = {"t": 1.0, "gpus": [], "nvml_error": "", "disk": {"total": 1, "free": 1, "used": 0},
              "host": {"ram_total": 1, "ram_available": 1, "load1": 0.0}}
    payloads.send_node_sample(9, sample)
    assert _messages(sent) == [("node:9", "sample", sample, True)]
    with pytest.raises(TypeError):
        payloads.send_node_sample(9, {**sample, "gpu": []})


def test_a_node_sample_also_sets_the_fleet_pages_state_to_what_a_node_card_shows():
    import json

    gpu = {"index": 0, "memory_used": 5, "memory_total": 10, "util_gpu": 50, "temperature_c": 40, "power_w": 100.0}
    sample = {"t": 1.0, "gpus": [gpu], "nvml_error": "", "disk": {"total": 8, "free": 3, "used": 5},
              "host": {"ram_total": 1, "ram_available": 1, "load1": 0.0}}
    payloads.send_node_sample(9, sample)
    shown = {"t": 1.0, "gpus": [{"index": 0, "memory_used": 5, "memory_total": 10, "util_gpu": 50}],
             "disk": {"total": 8, "free": 3}}  # static/panel/fleet.js reads these
    assert {k: json.loads(v) for k, v in fleetfeed.fleet_state().items()} == {"9": shown}
    assert json.loads(fleetfeed.fleet_message(fleetfeed.fleet_state(), snapshot=True)) == {
        "topic": "fleet", "kind": "nodes", "data": {"nodes": {"9": shown}}, "snapshot": True}


def test_a_runs_status_point_and_tick_go_to_the_run_page(sent):
    run = BenchmarkRunFactory(status="running", warnings=["w"])
    point = BenchmarkPointFactory(run=run, concurrency=4)
    benchmark_payloads.send_run_status(run)
    benchmark_payloads.send_run_point(run.pk, point)
    benchmark_payloads.send_run_tick(run.pk, benchmark_payloads.RunTick(t=1.5, concurrency=4, tok_s=99.0, in_flight=4,
                                                                        completed=2, failed=0, server={}))
    (t1, k1, status, _), (_, k2, data, _), (_, k3, tick, keep) = _messages(sent)
    assert (t1, k1, k2, k3, keep) == (f"run:{run.pk}", "status", "point.4", "tick", False)
    assert status == {"status": "running", "status_display": "Running", "error": "", "single_stream_tok_s": None,
                      "warnings": ["w"], "capacity": {}}
    assert data["concurrency"] == 4 and data["output_throughput"] == point.output_throughput
    assert set(data) == {"concurrency", "output_throughput", "total_token_throughput", "request_throughput", "ttft_ms",
                         "ttft_vllm_bench_ms",
                         "ttfc_ms", "tpot_ms", "itl_ms", "itl_per_token_ms", "e2e_ms", "tok_s_per_user",
                         "reasoning_tokens", "content_tokens", "output_tokens", "num_requests", "failed_requests",
                         "server_metrics", "prompt_tokens_requested", "prompt_tokens_mean", "prompt_tokens_counted_by",
                         "energy_j", "watts_per_gpu", "joules_per_token", "energy_net_j", "joules_per_token_net", "rejected",
                         "kind", "rate", "achieved_rate", "lag_ms", "slot_wait_ms",  # a rate level's schedule
                         "goodput", "slo", "repeat",  # against the run's SLOs; a capacity search's repeat
                         "warmup_requests", "timeouts", "errors"}
    assert data["kind"] == "concurrency"
    assert tick == {"t": 1.5, "concurrency": 4, "tok_s": 99.0, "in_flight": 4, "completed": 2, "failed": 0, "server": {},
                    "rate": 0.0}
