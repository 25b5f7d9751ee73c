"""The sleep probe (deployments/node/sleepprobe.py): its verdict on each level's figures, and the probe run against the
fake engine held to vLLM's sleep protocol (tests/conformance): a conforming one passes, one whose sleep frees nothing
and one whose answers change after a wake are refused with their figures, and a sleep is refused, or probed first,
by what the probe of its combination found. The fake's core holds its weights in host RAM, so the test reads that
RAM as GPU 0's memory (on a GPU, tests/gpu/test_sleep_gpu.py reads NVML)."""
import json
import os
import subprocess
from unittest import mock

import pytest

from deployments.host import processes, vllm
from deployments.models import Deployment, SleepProbe
from deployments.node import sleep, sleepprobe
from deployments.node.steps import PlanFailed
from deployments.services import sleeps
from plumbing.errors import ServiceError
from tests.conformance.conftest import FAKE, KEY, SERVED
from tests.conftest import free_port, wait_until
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db
GIB, MIB = 1 << 30, 1 << 20
S = Deployment.Status
WEIGHTS_MB = 256


def test_a_level_passes_when_its_memory_went_came_back_and_the_answer_is_the_same():
    before = {0: 40 * GIB, 1: 40 * GIB}
    assert sleepprobe.judge(before, {0: GIB, 1: GIB}, {0: 40 * GIB, 1: 40 * GIB + 100 * MIB}, True) == []
    leaked = sleepprobe.judge(before, {0: 39 * GIB, 1: GIB}, before, True)
    assert leaked == ["GPU 0 still held 39.00 GiB asleep (at most 2.00 GiB may stay; 40.00 GiB before)"]
    grown = sleepprobe.judge(before, {0: GIB, 1: GIB}, {0: 40 * GIB, 1: 46 * GIB}, True)
    assert grown == ["GPU 1 held 46.00 GiB after the wake against 40.00 GiB before"]
    short = sleepprobe.judge(before, {0: GIB, 1: GIB}, {0: 30 * GIB, 1: 40 * GIB}, True)
    assert short == ["GPU 0 held 30.00 GiB after the wake against 40.00 GiB before"]
    assert sleepprobe.judge(before, {0: GIB, 1: GIB}, before, False) == [
        "the answer to the fixed prompt at temperature 0 changed after the wake"]
    assert sleepprobe.judge({}, {}, {}, True) == []  # nothing to read: only the answer decides


def test_the_combination_is_the_model_commit_engine_memory_flags_and_gpus():
    node = NodeFactory(engine_version="0.32.0")
    GpuFactory(node=node, index=0)
    d = DeploymentFactory(node=node, model=ModelCopyFactory(node=node).model, sleep_mode=True,
                          engine_args={"max-num-seqs": 64, "served-model-name": "a"})
    d.gpus.set(node.gpus.all())
    key = SleepProbe.key_of(d)
    d.engine_args["served-model-name"] = "b"  # no memory changes with a name
    assert SleepProbe.key_of(d) == key
    d.engine_args["max-num-seqs"] = 16
    assert SleepProbe.key_of(d) != key
    assert SleepProbe.combination_of(d)["flags"] == {"max-num-seqs": 16}


@pytest.fixture
def fake_engine(tmp_path):
    """Start the fake engine with sleep mode and a config; yields the function, stops what it started."""
    started = []

    def start(**config) -> tuple[subprocess.Popen, int]:
        model = tmp_path / f"model-{len(started)}"
        model.mkdir()
        (model / "fake_engine.json").write_text(json.dumps({"load_s": 0.1, "sleep_s": 0.05, "wake_s": 0.05,
                                                             "weights_mb": WEIGHTS_MB, **config}))
        port, log = free_port(), tmp_path / f"engine-{len(started)}.log"
        env = dict(os.environ, VLLM_API_KEY=KEY, VLLM_SERVER_DEV_MODE="1")
        proc = subprocess.Popen([str(FAKE / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
                                 SERVED, "--enable-sleep-mode"], env=env, stdout=log.open("ab"),
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        started.append(proc)
        wait_until(lambda: vllm.health(f"http://127.0.0.1:{port}") or proc.poll() is not None, 30,
                   message="the fake engine to serve")
        assert proc.poll() is None, log.read_text()
        return proc, port

    yield start
    for proc in started:
        processes.stop(proc.pid, term_timeout_s=5, kill_timeout_s=5)  # its whole group: the core child too
        proc.wait(5)


@pytest.fixture
def probed(monkeypatch):
    """The probe reads the fake core's host RAM as GPU 0 (the engine group's resident set) and has no room for level
    1 (the fake cannot move weights it has in host RAM already); what a sleeping engine keeps is 128 MiB here."""
    monkeypatch.setattr(sleepprobe, "key", lambda d: KEY)
    monkeypatch.setattr(sleepprobe, "gpu_held", lambda d: {0: sleepprobe.group_rss(d)})
    monkeypatch.setattr(sleepprobe, "SLEEP_RESIDUAL_BYTES", 128 * MIB)
    monkeypatch.setattr(sleepprobe, "SETTLE_S", 3.0)
    monkeypatch.setattr(sleepprobe.psutil, "virtual_memory", lambda: mock.Mock(available=1 * GIB))


def _deployment(proc, port, **fields) -> Deployment:
    node = NodeFactory(engine_version="0.32.0")
    GpuFactory(node=node, index=0)
    model = ModelCopyFactory(node=node).model
    model.total_size = 100 * GIB
    model.save()
    d = DeploymentFactory(node=node, model=model, status=S.READY, sleep_mode=True, port=port, pid=proc.pid,
                          pgid=proc.pid, engine_args={"served-model-name": SERVED}, **fields)
    d.gpus.set(node.gpus.all())
    return Deployment.objects.select_related("model", "node").get(pk=d.pk)


def test_a_conforming_engine_passes_and_its_figures_are_kept(fake_engine, probed):
    d = _deployment(*fake_engine())
    probe = sleepprobe.run(d)
    assert probe.verdict == SleepProbe.Verdict.PASSED, probe.levels
    one, two = probe.levels
    assert not one["tried"] and "do not fit in the host's 1.0 GiB of free RAM" in one["why"]
    assert two["tried"] and two["passed"] and two["answer_same"]
    assert isinstance(two["sleep_s"], float) and isinstance(two["wake_s"], float)  # recorded, whatever they took
    assert two["gpu_before"]["0"] - two["gpu_asleep"]["0"] >= WEIGHTS_MB * MIB * 0.9  # the weights went
    assert abs(two["gpu_after"]["0"] - two["gpu_before"]["0"]) < 64 * MIB  # and came back
    event = d.events.get(step="sleep_probe")
    assert event.message.startswith("Sleep probe passed: level 1 not tried") and "level 2 passed" in event.message
    assert vllm.is_sleeping(f"http://127.0.0.1:{d.port}", key=KEY) is False  # left serving


def test_an_engine_whose_sleep_frees_nothing_is_refused_with_its_figures(fake_engine, probed):
    d = _deployment(*fake_engine(sleep_leak=True))
    probe = sleepprobe.run(d)
    assert probe.verdict == SleepProbe.Verdict.FAILED
    assert "level 2 failed: GPU 0 still held" in probe.reason and "(at most 0.12 GiB may stay" in probe.reason
    with pytest.raises(PlanFailed, match="Sleep refused: the sleep probe of .* failed .*GPU 0 still held"):
        sleep.put_to_sleep(d)
    with pytest.raises(ServiceError, match="GPU 0 still held") as refused:
        sleeps.deployment_sleep(d)
    assert refused.value.code == "sleep_probe_failed"


def test_an_engine_whose_answer_changes_after_a_wake_is_refused(fake_engine, probed):
    d = _deployment(*fake_engine(wake_garbles=True))
    probe = sleepprobe.run(d)
    assert probe.verdict == SleepProbe.Verdict.FAILED and probe.levels[1]["answer_same"] is False
    assert "the answer to the fixed prompt at temperature 0 changed after the wake" in probe.reason


def test_the_first_real_sleep_is_probed_once_and_later_sleeps_use_its_verdict(fake_engine, probed):
    d = _deployment(*fake_engine())
    with mock.patch.object(sleep, "_key", lambda d: KEY), mock.patch.object(sleep, "wake_blockers", lambda d: []):
        sleep.put_to_sleep(d)
        d = Deployment.objects.select_related("model", "node").get(pk=d.pk)
        assert (d.status, d.sleep_level) == (S.SLEEPING, 2)
        sleep.wake(d)
        sleep.put_to_sleep(Deployment.objects.select_related("model", "node").get(pk=d.pk))
    assert SleepProbe.objects.count() == 1
    assert list(d.events.order_by("pk").values_list("step", flat=True)) == ["sleep_probe", "sleep", "wake", "sleep"]
    with pytest.raises(PlanFailed, match="level 1 was not proven by the sleep probe"):
        Deployment.objects.filter(pk=d.pk).update(status=S.READY)
        sleep.put_to_sleep(Deployment.objects.select_related("model", "node").get(pk=d.pk), level=1)


@pytest.fixture
def sent(sent_tasks):
    return lambda: [(s.name, s.args) for s in sent_tasks.commit()]


def _row(**fields) -> Deployment:
    node = NodeFactory(engine_version="0.32.0")
    GpuFactory(node=node, index=0)
    d = DeploymentFactory(node=node, model=ModelCopyFactory(node=node).model, **{"name": "kimi", **fields})
    d.gpus.set(node.gpus.all())
    return d


def _failed(d) -> SleepProbe:
    level = {"level": 2, "tried": True, "passed": False, "problems": ["GPU 0 still held 30.00 GiB asleep"],
             "sleep_s": 1.5, "wake_s": 2.5, "gpu_before": {"0": 31 * GIB}, "gpu_asleep": {"0": 30 * GIB},
             "gpu_after": {"0": 31 * GIB}, "ram_taken_bytes": 0, "answer_same": True}
    probe = SleepProbe(node=d.node, model=d.model, deployment=d, key=SleepProbe.key_of(d),
                       combination=SleepProbe.combination_of(d), verdict=SleepProbe.Verdict.FAILED, levels=[level])
    probe.reason = probe.summary()
    probe.save()
    return probe


def test_the_api_and_the_page_probe_on_demand_and_show_the_verdict(api, operator_client, sent):
    d = _row(status=S.READY, sleep_mode=True)
    assert api.get(f"/api/deployments/{d.pk}/").json()["sleep_probe"] is None
    page = operator_client.get(f"/deployments/{d.pk}/").content.decode()
    assert 'data-action="sleep-probe"' in page and "not probed yet: the first sleep probes it" in page
    assert 'data-action="sleep"' in page
    assert api.post(f"/api/deployments/{d.pk}/sleep-probe/", format="json").status_code == 202
    assert sent() == [("deployments.deployment_sleep_probe", [d.pk])]
    assert d.events.get(step="sleep_probe").message.startswith("Sleep probe requested")
    _failed(d)
    shown = api.get(f"/api/deployments/{d.pk}/").json()["sleep_probe"]
    assert shown["verdict"] == "failed" and shown["levels"][0]["gpu_asleep"] == {"0": 30 * GIB}
    assert shown["reason"].startswith("level 2 failed: GPU 0 still held 30.00 GiB asleep (sleep 1.50 s, wake 2.50 s; "
                                      "GPU 0 1.00 GiB freed")
    page = operator_client.get(f"/deployments/{d.pk}/").content.decode()
    assert 'id="sleep-probe"><span class="badge failed">failed</span>' in page and "GPU 0 still held 30.00 GiB" in page
    assert 'data-action="sleep"' not in page  # offered only where the probe passed (or never ran)
    refused = api.post(f"/api/deployments/{d.pk}/sleep/", {}, format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "sleep_probe_failed"
    plain = _row(status=S.READY, name="plain")
    refused = api.post(f"/api/deployments/{plain.pk}/sleep-probe/", format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_sleep_mode"


def test_a_swap_from_a_deployment_whose_probe_failed_is_refused():
    a = _row(status=S.READY, sleep_mode=True)
    b = DeploymentFactory(node=a.node, model=a.model, status=S.SLEEPING, sleep_mode=True, name="b")
    b.gpus.set(a.node.gpus.all())
    _failed(a)
    with pytest.raises(ServiceError, match="Sleep refused for kimi: the sleep probe of .* failed") as refused:
        sleeps.deployment_swap(a, b)
    assert refused.value.code == "sleep_probe_failed"


def test_panelctl_probes_and_prints_each_levels_figures(monkeypatch, capsys):
    from panelctl import cli

    probe = {"id": 3, "verdict": "failed", "reason": "level 2 failed: GPU 0 still held 30.00 GiB asleep",
             "levels": [{"level": 1, "tried": False, "passed": False, "why": "level 2: 547.0 GiB of weights do not fit"},
                        {"level": 2, "tried": True, "passed": False, "sleep_s": 1.5, "wake_s": 2.5,
                         "gpu_before": {"0": 31 * GIB}, "gpu_asleep": {"0": 30 * GIB}, "gpu_after": {"0": 31 * GIB},
                         "answer_same": True}]}
    asked, reads = [], []

    class Panel:
        def __init__(self, *a):
            pass

        def get(self, path, **params):
            if path == "deployments/":
                return {"results": [{"id": 7}]}
            reads.append(path)
            return {"id": 7, "name": "kimi", "status": "ready", "sleep_probe": probe if len(reads) > 2 else None}

        def post(self, path, body=None, key=None):
            asked.append(path)
            return {"id": 7, "name": "kimi", "status": "ready"}

    monkeypatch.setattr(cli, "Panel", Panel)
    monkeypatch.setattr("panelctl.sleep.time.sleep", lambda s: None)
    assert cli.main(["--url", "http://x", "--token", "t", "sleep-probe", "kimi", "--wait"]) == 1
    assert asked == ["deployments/7/sleep-probe/"]
    out = capsys.readouterr().out.splitlines()
    assert out == ["failed: level 2 failed: GPU 0 still held 30.00 GiB asleep",
                   "  level 1: not tried (level 2: 547.0 GiB of weights do not fit)",
                   "  level 2: failed, sleep 1.50 s, wake 2.50 s, GPU before/asleep/after 0: 31.00/30.00/31.00 GiB, "
                   "answer same"]


def test_the_page_says_which_level_a_sleep_would_take_before_the_user_picks_it(operator_client, monkeypatch):
    d = _row(status=S.READY, sleep_mode=True)
    d.model.total_size = 547 * GIB
    d.model.save()
    free = {"ram_available": 400 * GIB}
    monkeypatch.setattr(sleeps.history, "latest_many", lambda ids: {i: free for i in ids})
    assert sleeps.sleep_fit(d) == ("A sleep now would take level 2: 547.0 GiB of weights do not fit in the host's 400.0 "
                                   "GiB of free RAM with 4 GiB to spare; they are dropped and read again at wake; the "
                                   "first sleep is probed first.")
    SleepProbe.objects.create(node=d.node, model=d.model, deployment=d, key=SleepProbe.key_of(d),
                              combination=SleepProbe.combination_of(d), verdict=SleepProbe.Verdict.PASSED,
                              levels=[{"level": 1, "tried": True, "passed": True}, {"level": 2, "tried": True,
                                                                                   "passed": True}])
    free["ram_available"] = 1000 * GIB
    page = operator_client.get(f"/deployments/{d.pk}/").content.decode()
    assert ('<p id="sleep-fit" class="muted">A sleep now would take level 1: its 547.0 GiB of weights go to host RAM '
            "(1000.0 GiB free) (proven by the sleep probe).</p>") in page
