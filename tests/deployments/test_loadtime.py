"""deployments.services.loadtime: a load's phases kept with its timeline, history, prediction basis,
the store's read rate, and start-up in run environments."""
import os
from datetime import timedelta

import pytest
from django.utils import timezone

from benchmarks.services import environment_of
from deployments import selectors
from deployments.models import DeploymentEvent, Node
from deployments.services import loadtime
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory
from tests.host.test_loadphases import CPU_LOG

pytestmark = pytest.mark.django_db


def _load(d, lines=CPU_LOG.splitlines(), pid=None):
    """Follow a load as engines._follow does: a `load` step, lines fed, ready, smoke test done."""
    d.started, d.pid = timezone.now() - timedelta(seconds=1), pid
    watch = loadtime.LoadWatch(d)
    event = DeploymentEvent.objects.create(deployment=d, step="load", message="…")
    watch.event_id = event.pk
    watch.feed(lines)
    detail = watch.detail()
    changes = watch.ready()
    event.ended = timezone.now()
    event.save()
    watch.finish()
    event.refresh_from_db()
    return watch, detail, changes, event


def test_a_finished_load_keeps_its_phases_and_the_next_one_predicts_from_it():
    d = DeploymentFactory()
    _, first_detail, first_changes, event = _load(d)
    assert first_detail["prediction"] is None and "no earlier load" in first_detail["basis"]
    assert first_changes == ""
    assert {"process", "api_up", "smoke_test"} <= set(event.data["totals"])
    assert event.data["key"] == loadtime.load_key(d)

    watch, detail, _, _ = _load(d, lines=CPU_LOG.splitlines()[:3])
    assert detail["prediction"] is not None
    assert detail["basis"].startswith("1 earlier load of this model, flags, engine and node")
    assert detail["previous"] == event.data["totals"]
    assert watch.history == [event.data["totals"]]


def test_other_flags_are_another_history_and_another_node_is_scaled_by_its_disk():
    d = DeploymentFactory(node=NodeFactory(disk_read={"bps": 2e9}))
    _load(d)
    other_flags = DeploymentFactory(model=d.model, node=d.node, engine_args={"max-model-len": 512})
    assert loadtime.load_history(other_flags)[0] == []  # same node: no scaling across flags
    slow_node = NodeFactory(disk_read={"bps": 1e9})
    elsewhere = DeploymentFactory(model=d.model, node=slow_node)
    history, basis, scale, _ = loadtime.load_history(elsewhere)
    assert len(history) == 1 and scale == 2.0 and d.node.name in basis
    unmeasured = DeploymentFactory(model=d.model, node=NodeFactory())
    assert loadtime.load_history(unmeasured)[0] == []


def test_a_load_followed_again_after_an_agent_restart_is_shown_but_not_learned_from():
    d = DeploymentFactory()
    d.started, d.pid = timezone.now() - timedelta(minutes=5), None
    watch = loadtime.LoadWatch(d)
    event = DeploymentEvent.objects.create(deployment=d, step="load", ended=timezone.now())
    watch.event_id = event.pk
    watch.feed(CPU_LOG.splitlines())
    watch.ready()
    watch.finish()
    event.refresh_from_db()
    assert "segments" in event.data and "totals" not in event.data
    assert not selectors.load_events(deployment=d).exists()
    d.refresh_from_db()
    assert d.load_detail["phases"]["segments"]


def test_the_detail_reports_model_size_residency_and_free_ram(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(1 << 20))
    d = DeploymentFactory()
    ModelCopyFactory(model=d.model, node=d.node, path=str(folder))
    _, detail, _, _ = _load(d, pid=os.getpid())
    assert detail["model_bytes"] == 1 << 20
    assert detail["resident_bytes"] is not None and 0 <= detail["resident_bytes"] <= 1 << 20
    assert detail["ram_available"] > 0 and detail["read_bps"] >= 0


def test_measuring_the_store_keeps_its_rate_on_the_node(tmp_path):
    node = NodeFactory()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(2 << 20))
    ModelCopyFactory(node=node, path=str(folder))
    result = loadtime.node_measure_disk(node, max_bytes=1 << 20)
    assert result["bytes"] == 1 << 20 and result["bps"] > 0
    assert Node.objects.get(pk=node.pk).disk_read["bps"] == result["bps"]


def test_a_run_environment_carries_the_deployments_start_up():
    d = DeploymentFactory()
    assert environment_of(d)["startup"] == {}
    _, _, _, event = _load(d)
    startup = environment_of(d)["startup"]
    assert startup["totals"] == event.data["totals"]
    assert startup["ready_s"] == pytest.approx(sum(v for k, v in event.data["totals"].items() if k != "smoke_test"), abs=0.1)
