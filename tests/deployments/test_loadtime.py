"""deployments/loads.py: a load's phases kept with its timeline, history, prediction basis,
the store's read rate, and start-up in run environments."""
import os
from datetime import timedelta

import psutil
import pytest
from django.utils import timezone

from benchmarks.services import environment_of
from deployments import loads, selectors
from deployments.models import DeploymentEvent, Node
from deployments.models import Deployment
from deployments.node import plan
from tests.deployments.test_deploys import _queued, host, model, node  # noqa: F401 - fixtures of the plan's tests
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory

S = Deployment.Status
from tests.host.test_loadphases import CPU_LOG

pytestmark = pytest.mark.django_db


def _load(d, lines=CPU_LOG.splitlines(), pid=None):
    """Follow a load as plan._follow does: a `load` step, lines fed, ready, smoke test done."""
    d.started, d.pid = timezone.now() - timedelta(seconds=1), pid
    watch = loads.LoadWatch(d)
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
    assert event.data["key"] == loads.load_key(d)

    watch, detail, _, _ = _load(d, lines=CPU_LOG.splitlines()[:3])
    assert detail["prediction"] is not None
    assert detail["basis"].startswith("1 earlier load of this model, flags, engine and node")
    assert detail["previous"] == event.data["totals"]
    assert watch.history == [event.data["totals"]]


def test_a_load_whose_api_lines_were_not_read_yet_when_the_api_answered_still_has_its_api_up_phase():
    """/health can answer between one read of the log and the next (CI: a busy host's Gantt had no "API up"):
    the API answering is the API up, whatever the log has said so far."""
    lines = CPU_LOG.splitlines()
    before_api = lines[:next(i for i, line in enumerate(lines) if "init engine" in line)]
    _, _, _, event = _load(DeploymentFactory(), lines=before_api)
    phases = [p for p, _, _ in event.data["segments"]]
    assert phases[-2:] == ["api_up", "smoke_test"]


def test_other_flags_are_another_history_and_another_node_is_scaled_by_its_disk():
    d = DeploymentFactory(node=NodeFactory(disk_read={"bps": 2e9}))
    _load(d)
    other_flags = DeploymentFactory(model=d.model, node=d.node, engine_args={"max-model-len": 512})
    assert loads.load_history(other_flags)[0] == []  # same node: no scaling across flags
    slow_node = NodeFactory(disk_read={"bps": 1e9})
    elsewhere = DeploymentFactory(model=d.model, node=slow_node)
    history, basis, scale, _ = loads.load_history(elsewhere)
    assert len(history) == 1 and scale == 2.0 and d.node.name in basis
    unmeasured = DeploymentFactory(model=d.model, node=NodeFactory())
    assert loads.load_history(unmeasured)[0] == []


def _finished_load(d, watch) -> DeploymentEvent:
    event = DeploymentEvent.objects.create(deployment=d, step="load", ended=timezone.now())
    watch.event_id = event.pk
    watch.feed(CPU_LOG.splitlines())
    watch.ready()
    watch.finish()
    event.refresh_from_db()
    return event


def test_a_load_the_plan_launched_is_learned_from_even_when_its_watch_started_late():
    """A busy host may start following a load long after launch: still this plan's own load."""
    d = DeploymentFactory()
    d.started, d.pid = timezone.now() - timedelta(minutes=5), None
    event = _finished_load(d, loads.LoadWatch(d))
    assert event.data["totals"] and selectors.load_events(deployment=d).exists()


def test_an_agent_restart_follows_a_load_as_not_fresh(monkeypatch):
    d = DeploymentFactory(status=Deployment.Status.LOADING, pid=12345)
    followed = []
    monkeypatch.setattr(plan, "_follow", lambda row, fresh=True: followed.append((row.pk, fresh)))
    plan.deployment_follow(d.pk)
    assert followed == [(d.pk, False)]


def test_a_load_followed_again_after_an_agent_restart_is_shown_but_not_learned_from():
    d = DeploymentFactory()
    d.started, d.pid = timezone.now() - timedelta(minutes=5), None
    event = _finished_load(d, loads.LoadWatch(d, fresh=False))
    assert "segments" in event.data and "totals" not in event.data
    assert not selectors.load_events(deployment=d).exists()
    d.refresh_from_db()
    assert d.load_detail["phases"]["segments"]


def test_a_load_followed_again_closes_the_lost_agents_open_step_and_blames_nothing_on_the_engine():
    """The agent killed mid-load left its load step open ("load … …" on the timeline), and the load followed again
    said "Process start 56 s slower than last time": the agent's outage, taken for the engine's."""
    d = DeploymentFactory()
    d.started, d.pid = timezone.now() - timedelta(minutes=5), None
    _load(DeploymentFactory(model=d.model, node=d.node, engine_args=d.engine_args))  # a previous load to compare with
    lost = DeploymentEvent.objects.create(deployment=d, step="load")  # the killed agent's, never ended
    watch = loads.LoadWatch(d, fresh=False)
    lost.refresh_from_db()
    assert lost.ended is not None and lost.level == DeploymentEvent.Level.WARNING
    assert lost.message.startswith("The node agent following this load was lost; a new agent follows it from here")
    watch.feed(CPU_LOG.splitlines())
    assert watch.previous and watch.ready() == ""  # a previous load there is, and no comparison is made
    fresh = loads.LoadWatch(d)
    fresh.feed(CPU_LOG.splitlines())
    assert fresh.ready() != ""  # the same lines, followed by the plan that launched them, are compared


def test_a_fresh_load_is_calibrated_a_replayed_one_is_not_and_a_failed_calibration_never_fails_the_load(monkeypatch):
    """The node calibrates the KV estimate itself (deployments/kvcalibration.py, beneath both sides)."""
    from deployments import kvcalibration

    learnt = []

    def calibrate(d, engine_kv):
        learnt.append((d.pk, engine_kv))
        raise RuntimeError("boom")

    monkeypatch.setattr(kvcalibration, "load_calibrate", calibrate)
    fresh, replayed = DeploymentFactory(), DeploymentFactory()
    watch, _, _, event = _load(fresh)
    _finished_load(replayed, loads.LoadWatch(replayed, fresh=False))
    assert learnt == [(fresh.pk, watch.engine_kv)]
    fresh.refresh_from_db()
    assert event.data["totals"] and fresh.load_detail["phases"]  # the load is kept all the same


def _cold(*paths) -> None:
    """Written out and dropped from the page cache (by the test itself, not the code under test), or the test is
    skipped: a filesystem whose page cache ignores POSIX_FADV_DONTNEED (tmpfs) has no cold start to measure."""
    from deployments.host import pagecache

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = pagecache.residency(list(paths))
    if left.resident:
        pytest.skip(f"{left.resident} of {left.total} bytes stayed in the page cache after POSIX_FADV_DONTNEED here: "
                    "no cold precondition")


def test_the_detail_reports_model_size_residency_the_engines_read_rate_and_free_ram(tmp_path, monkeypatch):
    """The engine is a shell that reads its weights cold when told; the watch's clock is the test's, so the rate is
    exactly the bytes it fetched from storage (its /proc/<pid>/io) over the seconds the clock moved."""
    import subprocess
    import time
    from types import SimpleNamespace

    from tests.helpers import started

    folder = tmp_path / "m"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(os.urandom(4 << 20))
    _cold(weights)
    d = DeploymentFactory()
    ModelCopyFactory(model=d.model, node=d.node, path=str(folder))
    clock = [1000.0]
    monkeypatch.setattr(loads, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    engine = started(subprocess.Popen(["sh", "-c", f"read go; cat {weights} > /dev/null; echo read; read end"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        d.started, d.pid = timezone.now(), engine.pid
        watch = loads.LoadWatch(d)
        base = watch.io[1]  # what the process had fetched from storage when the watch began
        cold = watch.detail()
        engine.stdin.write("go\n")
        engine.stdin.flush()
        assert engine.stdout.readline() == "read\n"
        clock[0] += loads.RESIDENCY_EVERY_S  # one read-rate window (>= 1 s) and one residency period later
        warm = watch.detail()
    finally:
        engine.kill()
        engine.wait()
    assert cold["model_bytes"] == warm["model_bytes"] == 4 << 20
    assert (cold["resident_bytes"], cold["read_bps"]) == (0, 0)  # nothing read yet, and no rate before a window
    assert warm["resident_bytes"] == 4 << 20
    # The rate is the bytes the process fetched over the window: the cold file, and whatever else its `cat` had to
    # page in from storage (a busy host evicts /bin/cat too: CI saw one page more, 4 MiB + 4,096 B).
    fetched = watch.io[1] - base
    assert warm["read_bps"] == round(fetched / loads.RESIDENCY_EVERY_S)
    assert 4 << 20 <= fetched <= (4 << 20) + (1 << 20)
    assert 0 < warm["ram_available"] <= psutil.virtual_memory().total


def test_measuring_the_store_keeps_its_rate_on_the_node(tmp_path):
    node = NodeFactory()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(2 << 20))
    ModelCopyFactory(node=node, path=str(folder))
    result = loads.node_measure_disk(node.pk, max_bytes=1 << 20)
    assert result["bytes"] == 1 << 20 and result["bps"] > 0
    assert Node.objects.get(pk=node.pk).disk_read["bps"] == result["bps"]


def test_a_run_environment_carries_the_deployments_start_up():
    d = DeploymentFactory()
    assert environment_of(d)["startup"] == {}
    _, _, _, event = _load(d)
    startup = environment_of(d)["startup"]
    assert startup["totals"] == event.data["totals"]
    assert startup["ready_s"] == pytest.approx(sum(v for k, v in event.data["totals"].items() if k != "smoke_test"), abs=0.1)


def test_prewarm_reads_the_model_into_the_page_cache_and_says_so_on_its_step(tmp_path, monkeypatch):
    from deployments.host import pagecache
    folder = tmp_path / "m"
    folder.mkdir()
    for i in range(3):
        (folder / f"model-{i}.safetensors").write_bytes(os.urandom(2 << 20))
    files = pagecache.weight_files(folder)
    _cold(*files)  # the precondition: none of it in the page cache, so the pre-warm's reads are what bring it in
    warm = loads.Prewarm(str(folder), workers=3)
    event = DeploymentEvent.objects.create(deployment=DeploymentFactory(), step="prewarm")
    measured, real = [], pagecache.residency
    monkeypatch.setattr(pagecache, "residency", lambda paths: measured.append(real(paths)) or measured[-1])
    message = warm.wait(event)
    # Every byte read through the page cache, and the step says what mincore() saw right after. Not a second look
    # later: a host under memory pressure evicted two pages in between (99.9 %).
    assert warm.done == warm.total == 6 << 20 and measured[-1].total == 6 << 20
    assert f"{measured[-1].percent:.0f} % of the model is in the page cache" in message
    assert "100 % of the model is in the page cache" in message


def test_prewarm_is_skipped_with_a_reason_when_the_model_does_not_fit_in_free_ram(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 4096)
    monkeypatch.setattr(loads, "PREWARM_RAM_SHARE", 0.0)
    warm = loads.Prewarm(str(tmp_path))
    message = warm.wait(DeploymentEvent.objects.create(deployment=DeploymentFactory(), step="prewarm"))
    assert message.startswith("Skipped: the model") and "free RAM" in message


def test_the_recommendation_names_prefetch_only_where_this_vllm_offers_it(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 4096)
    d = DeploymentFactory(node=NodeFactory(engine_flags=["safetensors-load-strategy", "load-format"]))
    ModelCopyFactory(model=d.model, node=d.node, path=str(tmp_path))
    assert any(r.startswith("--safetensors-load-strategy prefetch") for r in loads.load_recommendation(d))
    d.engine_args = {"safetensors-load-strategy": "prefetch"}
    assert loads.load_recommendation(d) == []  # already chosen
    old = DeploymentFactory(model=d.model, node=NodeFactory(engine_flags=["load-format"]))
    ModelCopyFactory(model=d.model, node=old.node, path=str(tmp_path))
    assert loads.load_recommendation(old) == []


def test_the_plan_with_prewarm_reads_the_shards_before_launch_and_keeps_the_loads_phases(model, node, host, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(os.urandom(1 << 20))
    _cold(folder / "model.safetensors")  # none of it in the page cache: the plan's pre-warm is what reads it in
    d = _queued(model, node, prewarm=True)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY
    assert [e.step for e in d.events.all()] == ["model", "checks", "stop_others", "gpu_memory", "prewarm", "launch", "load", "smoke_test"]
    # What the step measured right after its reads: a second look after the whole plan finds what memory pressure
    # left (1,015,808 of 1,048,576 bytes in a fast tier beside a full run), which is the host's business, not the plan's.
    assert "100 % of the model is in the page cache" in d.events.get(step="prewarm").message
    load = d.events.get(step="load")
    assert {"process", "weights", "api_up", "smoke_test"} <= set(load.data["totals"])
    assert d.load_detail["phases"]["segments"][0][0] == "process"


def test_the_agent_measures_a_store_once_and_an_operator_can_ask_again(tmp_path, operator_client, sent_tasks):
    node = NodeFactory()
    assert loads.node_measure_disk_once(node.pk) == {}  # no model here yet: nothing to read
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(1 << 20))
    ModelCopyFactory(node=node, path=str(folder))
    first = loads.node_measure_disk_once(node.pk)
    assert first["bytes"] == 1 << 20
    assert loads.node_measure_disk_once(node.pk) == {}  # once
    response = operator_client.post(f"/api/nodes/{node.name}/measure-disk/")
    assert response.status_code == 202 and response.json()["disk_read"]["bps"] == first["bps"]
    assert sent_tasks.commit().one("deployments.node_measure_disk").queue == node.queue
