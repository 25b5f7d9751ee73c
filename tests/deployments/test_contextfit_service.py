"""How much context fits, shown before Deploy, and the calibration after each load from the engine's own log,
on recorded real CPU engine logs."""
import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.urls import reverse
from django.utils import timezone

from deployments import contextfit, kvcalibration, loads
from deployments.models import DeploymentEvent, FitCalibration
from deployments.services import contextfit as service
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
FIXTURES = Path(__file__).parent.parent / "fixtures"
GB, GiB = 10**9, 2**30
# Real CPU vLLM 0.32 starts of the tiny model with the KV cache sized by the engine (VLLM_CPU_KVCACHE_SPACE
# unset): `--gpu-memory-utilization` 0.12 and 0.16 of the host's RAM, minus what the worker held.
AUTO_LOGS = {0.12: "cpu-vllm-0.32-auto-kv-0.12.txt", 0.16: "cpu-vllm-0.32-auto-kv-0.16.txt"}
TINY_FILES = [{"path": "model.safetensors", "size": 1_904_056}]


def config(name):
    return json.loads((FIXTURES / "configs" / f"{name}.json").read_text())


def log_lines(name):
    return (FIXTURES / "enginelogs" / name).read_text().splitlines()


def test_the_table_for_kimi_on_eight_h200s_has_a_row_per_kv_dtype_and_dcp():
    node = NodeFactory()
    for i in range(8):
        GpuFactory(node=node, index=i)
    model = ModelRepoFactory(config=config("kimi-k2.5-int4"), total_size=547 * GB, files=[])
    shown = service.deploy_context(model, node, {"tensor-parallel-size": 8, "kv-cache-dtype": "fp8"}, {},
                                   recipe={"model": {"kv_cache_dtypes": ["auto", "fp8"], "supports_dcp": True}})
    rows = {(r["kv_dtype"], r["dcp"]): r for r in shown["rows"]}
    assert set(rows) == {(d, n) for d in ("auto", "fp8") for n in (1, 2, 4, 8)}
    assert rows[("fp8", 1)]["chosen"] and not rows[("auto", 1)]["chosen"]
    assert abs(rows[("fp8", 8)]["tokens"] - 16 * rows[("auto", 1)]["tokens"]) <= 16  # FP8 halves, DCP 8 divides by 8
    assert rows[("auto", 1)]["longest"] == 262_144  # the cache holds more than the model's own limit
    no_dcp = service.deploy_context(model, node, {"tensor-parallel-size": 8}, {}, recipe={"model": {"supports_dcp": False}})
    assert {r["dcp"] for r in no_dcp["rows"]} == {1}


def test_the_deploy_form_gets_the_context_before_deploy():
    node = NodeFactory(name="cpu-01", ram_total=24 * GiB, cpu_count=2)
    model = ModelRepoFactory(repo_id="acme/tiny", config=config("tiny-llama"), files=TINY_FILES, total_size=1_904_056)
    ModelCopyFactory(model=model, node=node, path="/models/tiny")
    from deployments.templatetags import hostchecks
    from deployments import forms

    form = forms.DeployForm(node=node, initial={"port": 8000, "served_model_name": "tiny",
                                                "env": "VLLM_CPU_KVCACHE_SPACE=1"})
    shown = hostchecks.deploy_context_fit({"model": model, "node": node, "form": form})["context_fit"]
    auto = next(r for r in shown["rows"] if r["kv_dtype"] == "auto")
    assert auto["tokens"] == 2_097_152  # 1 GiB / 512 B, what the real engine logs for this setting
    assert auto["sequences"] == 2_097_152 // 2048


def _deployment(node, model, utilization):
    d = DeploymentFactory(node=node, model=model, env={},
                          engine_args={"tensor-parallel-size": 1, "gpu-memory-utilization": utilization})
    d.started = timezone.now() - timedelta(seconds=1)
    return d


def _finished_load(d, lines):
    """Follow a load as plan._follow does: lines fed, ready, smoke test done (LoadWatch.finish calibrates)."""
    watch = loads.LoadWatch(d)
    watch.event_id = DeploymentEvent.objects.create(deployment=d, step="load", message="…").pk
    watch.feed(lines)
    watch.ready()
    watch.finish()


def test_calibration_on_recorded_real_engine_logs_lowers_the_next_error():
    first, second = (contextfit.EngineKv.from_lines(log_lines(AUTO_LOGS[u])) for u in (0.12, 0.16))
    assert first.tokens and not first.explicit and first.consumed_bytes
    # The node as its agent reports it: the RAM the engine sized its KV cache against.
    node = NodeFactory(ram_total=first.memory_total, cpu_count=2)
    model = ModelRepoFactory(config=config("tiny-llama"), files=TINY_FILES, total_size=1_904_056)
    later = _deployment(node, model, 0.16)
    before = kvcalibration.deployment_estimate(later)
    error_before = abs(before.tokens - second.tokens) / second.tokens

    _finished_load(_deployment(node, model, 0.12), log_lines(AUTO_LOGS[0.12]))
    cal = FitCalibration.objects.get()
    assert cal.observed_tokens == first.tokens and cal.correction_bytes != 0
    after = kvcalibration.deployment_estimate(later)
    error_after = abs(after.tokens - second.tokens) / second.tokens
    print(f"calibration: error {error_before:.1%} before, {error_after:.1%} after")
    assert error_after < error_before and error_after < 0.05, (error_before, error_after)

    _finished_load(later, log_lines(AUTO_LOGS[0.16]))
    assert FitCalibration.objects.count() == 2 and abs(FitCalibration.objects.first().error) == pytest.approx(
        error_after, abs=1e-4)


def test_an_explicit_kv_size_or_a_log_without_it_stores_nothing():
    node = NodeFactory(ram_total=16 * GiB, cpu_count=2)
    model = ModelRepoFactory(config=config("tiny-llama"), files=TINY_FILES, total_size=1_904_056)
    _finished_load(_deployment(node, model, 0.9), log_lines("cpu-vllm-0.32-eager.txt"))
    _finished_load(_deployment(node, model, 0.9), ["INFO nothing about the KV cache"])
    assert not FitCalibration.objects.exists()



def test_the_node_records_a_loads_calibration_without_entering_a_control_plane_service():
    """Following a load runs on the node: its calibration writes the row from code beneath both sides."""
    first = contextfit.EngineKv.from_lines(log_lines(AUTO_LOGS[0.12]))
    node = NodeFactory(ram_total=first.memory_total, cpu_count=2)
    model = ModelRepoFactory(config=config("tiny-llama"), files=TINY_FILES, total_size=1_904_056)
    entered = set()

    def profile(frame, event, arg):
        if event == "call":
            entered.add(frame.f_globals.get("__name__", ""))

    sys.setprofile(profile)
    try:
        _finished_load(_deployment(node, model, 0.12), log_lines(AUTO_LOGS[0.12]))
    finally:
        sys.setprofile(None)
    assert FitCalibration.objects.get().observed_tokens == first.tokens
    assert "deployments.kvcalibration" in entered
    assert sorted(m for m in entered if m.startswith("deployments.services")) == []
