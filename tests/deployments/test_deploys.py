"""Deployments: validation before acting, the plan's steps, loading, crashes, restarts, systemd.

Host modules (engine, gpu, vllm, systemd) are replaced at their boundary; the real engine runs
in tests/e2e/test_deploy.py and tests/host/test_engine_real.py.
"""
import contextlib
import itertools
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from deployments import payloads
from deployments.forms import DeployForm
from deployments.host import gpu, ownership, processes, systemd, vllm
from deployments.models import Deployment, DeploymentEvent
from deployments.node import persist, plan, reconcile, watch
from deployments.services import deploys
from plumbing.errors import ServiceError
from plumbing.live import snapshots
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory
from tests.helpers import marked, started

pytestmark = pytest.mark.django_db
S = Deployment.Status
FLAGS = {"--tensor-parallel-size", "--gpu-memory-utilization", "--max-model-len", "--enforce-eager", "--port", "--host",
         "--max-num-seqs", "--reasoning-parser", "--served-model-name", "--kv-cache-dtype"}


@pytest.fixture
def node(tmp_path):
    node = NodeFactory(name="gpu-01", model_store=str(tmp_path), engine_flags=sorted(FLAGS))
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * 10**9)
    return node


@pytest.fixture
def model(node, tmp_path):
    copy = ModelCopyFactory(node=node, path=str(tmp_path / "m"), model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    return copy.model


def _create(model, node, **kw):
    args = {"model": model, "node": node, "gpu_indices": [0, 1], "port": 8000,
            "engine_args": {"tensor-parallel-size": 2}, "env": {}}
    return deploys.deployment_create(**{**args, **kw})


def test_a_deploy_is_queued_on_the_nodes_own_plans_queue(model, node, sent_tasks):
    d = _create(model, node)
    assert d.status == S.QUEUED and d.gpu_indices == [0, 1]
    plan = sent_tasks.commit().one("deployments.deployment_run")
    assert (plan.queue, plan.args) == ("node.gpu-01.plans", [d.pk])
    assert d.events.get().step == "queued"


def test_the_timeline_says_what_a_redeploy_changed(model, node, sent_tasks):
    d = _create(model, node)
    for change in ({}, {"engine_args": {"tensor-parallel-size": 2}}, {"engine_args": {"tensor-parallel-size": 2, "max-num-seqs": 8}}):
        Deployment.objects.filter(pk=d.pk).update(status=S.READY)
        deploys.deployment_redeploy(d, **change)
    messages = list(d.events.filter(step="queued").order_by("pk").values_list("message", flat=True))[1:]
    assert messages == ["Redeploy requested (version 2).", "Redeploy requested (version 3).",
                        "Redeploy requested (version 4): --max-num-seqs 8 added."]


def test_tp_times_pp_must_fit_the_chosen_gpus(model, node, sent_tasks):
    with pytest.raises(ServiceError, match="TP × PP × DP = 8 needs 8 GPUs; 2 chosen") as exc:
        _create(model, node, engine_args={"tensor-parallel-size": 4, "pipeline-parallel-size": 2})
    assert exc.value.field == "tp" and not Deployment.objects.exists()


def test_gpus_busy_with_a_deploy_in_progress_are_refused_naming_the_holder(model, node, sent_tasks):
    holder = DeploymentFactory(node=node, status=S.LOADING, name="kimi-prod", port=9000)
    holder.gpus.set(node.gpus.filter(index__in=[1, 2]))
    with pytest.raises(ServiceError, match="kimi-prod is loading") as exc:
        _create(model, node)
    assert exc.value.code == "gpus_busy"


def test_a_ready_deployment_on_the_gpus_is_replaced_not_refused(model, node, sent_tasks):
    holder = DeploymentFactory(node=node, status=S.READY, port=8000)
    holder.gpus.set(node.gpus.filter(index__in=[0]))
    assert _create(model, node).status == S.QUEUED  # same port too: the holder is stopped first


def test_a_port_used_by_another_deployment_is_refused(model, node, sent_tasks):
    other = DeploymentFactory(node=node, status=S.READY, port=8000, name="other")
    other.gpus.set(node.gpus.filter(index__in=[7]))
    with pytest.raises(ServiceError, match="Port 8000 is used by other") as exc:
        _create(model, node)
    assert exc.value.code == "port_in_use"


def test_the_form_checks_flags_against_the_nodes_engine_and_env_names(node):
    form = DeployForm({"port": 8000, "tp": 2, "pp": 1, "dp": 1, "gpus": ["0", "1"], "gpu_memory_utilization": 0.9,
                       "kv_cache_dtype": "auto", "stall_seconds": 600,
                       "extra_flags": "--max-modle-len 4096", "env": "NCCL_PROTO=LL\nLD_PRELOAD=/tmp/x.so"}, node=node)
    assert not form.is_valid()
    assert "did you mean --max-model-len?" in form.errors["extra_flags"][0]
    assert "LD_PRELOAD is not allowed" in form.errors["env"][0]


def test_the_form_turns_fields_into_engine_flags_and_env(node):
    form = DeployForm({"port": 8001, "tp": 2, "pp": 1, "dp": 1, "gpus": ["0", "1"], "gpu_memory_utilization": 0.85,
                       "kv_cache_dtype": "fp8", "max_model_len": 4096, "reasoning_parser": "deepseek_r1",
                       "stall_seconds": 600, "extra_flags": "--enforce-eager", "env": "NCCL_PROTO=LL"}, node=node)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["engine_args"] == {
        "tensor-parallel-size": 2, "gpu-memory-utilization": 0.85, "max-model-len": 4096,
        "reasoning-parser": "deepseek_r1", "kv-cache-dtype": "fp8", "enforce-eager": True}
    assert form.cleaned_data["env_vars"] == {"NCCL_PROTO": "LL"}


def test_the_engines_admission_caps_have_fields_of_their_own(node):
    """vLLM's --max-num-queued-reqs/-tokens: set in their fields, checked against the node's engine like any flag."""
    fields = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpus": ["0"], "gpu_memory_utilization": 0.9,
              "kv_cache_dtype": "auto", "stall_seconds": 600, "max_num_queued_reqs": 64, "max_num_queued_tokens": 200000}
    node.engine_flags = [*node.engine_flags, "--max-num-queued-reqs", "--max-num-queued-tokens"]
    form = DeployForm(fields, node=node)
    assert form.is_valid(), form.errors
    assert {k: form.cleaned_data["engine_args"][k] for k in ("max-num-queued-reqs", "max-num-queued-tokens")} == {
        "max-num-queued-reqs": 64, "max-num-queued-tokens": 200000}
    node.engine_flags = [f for f in node.engine_flags if "queued" not in f]  # an engine from before vLLM 0.32
    old = DeployForm(fields, node=node)
    assert not old.is_valid() and "--max-num-queued-reqs" in str(old.errors)
    assert not DeployForm({**fields, "max_num_queued_reqs": 0}, node=node).is_valid()  # vLLM's 0 admits nothing


@pytest.mark.parametrize("flags, message", [
    ("--max-num-seqs 8; rm -rf /", "expected a --flag"),
    ("--port 9000", "--port is set by the panel"),
    ("--x$(id) 1", "is not a flag name"),
])
def test_shell_metacharacters_never_become_commands(node, flags, message):
    form = DeployForm({"port": 8000, "tp": 1, "pp": 1, "dp": 1, "gpus": ["0"], "gpu_memory_utilization": 0.9,
                       "kv_cache_dtype": "auto", "stall_seconds": 600, "extra_flags": flags}, node=node)
    assert not form.is_valid()
    assert message in form.errors["extra_flags"][0]


# --- the plan, on the node ----------------------------------------------------------------------

class FakeHost:
    """engine/gpu/vllm replaced at their boundary, scripted per test."""

    def __init__(self, tmp_path):
        self.log = tmp_path / "engine.log"
        self.health_after = 3
        self.alive = True
        self.owned = True  # the engines the plan started carry its marker
        self.calls = []
        patches = {
            "processes.port_free": mock.Mock(return_value=True),
            "serveargv.engine_flags": mock.Mock(return_value=FLAGS),
            # The engine's Python and which optional packages (enginemodules.MODULES) it has: none unless a test says.
            "enginemodules.importable": mock.Mock(return_value=("/opt/vllm/bin/python", set())),
            "processes.launch": mock.Mock(side_effect=self.launch),
            "processes.stop": mock.Mock(return_value=processes.StopResult(["SIGTERM"], 0.4, [], ["/dev/shm/psm_1"])),
            "processes.alive": mock.Mock(side_effect=lambda pid, ct=0.0: self.alive),
            "vllm.health": mock.Mock(side_effect=self.health),
            "processes.members": mock.Mock(return_value=[]),
            "processes.shm_files": mock.Mock(return_value=set()),
            "ownership.owned": mock.Mock(side_effect=lambda pgid, marker, unit=None: self.owned),
            "ownership.pid_owned": mock.Mock(side_effect=lambda pid, marker, unit=None: self.alive and self.owned),
            "ownership.engine_processes": mock.Mock(return_value=[]),
            "gpuwait.wait_memory_released": mock.Mock(return_value=[]),
            "gpu.processes_on": mock.Mock(return_value={}),
            "gpu.sample": mock.Mock(return_value=[]),
            "vllm.served_models": mock.Mock(return_value=["tiny"]),
            "listeners.listening": mock.Mock(return_value=(set(), True)),  # who listens: unknown, the key decides
            "vllm.smoke_test": mock.Mock(return_value=vllm.SmokeResult("Paris.", "", 0.42, 12, 3, None)),
        }
        self.mocks = patches
        self._patchers = [mock.patch(f"deployments.host.{name}", new) for name, new in patches.items()]

    def launch(self, spec):
        self.spec = spec
        self.log = spec.log_path
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        spec.log_path.write_text("Loading safetensors checkpoint shards: 50% Completed | 1/2\n"
                                 "Loading weights took 1.5 seconds\nStarting vLLM server on http://0.0.0.0:8000\n")
        return processes.EngineHandle(pid=4242, pgid=4242, create_time=1.0)

    def health(self, url, timeout=2.0):
        self.health_after -= 1
        return self.health_after <= 0

    def __enter__(self):
        for p in self._patchers:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self._patchers:
            p.stop()


@contextlib.contextmanager
def _clock(monotonic):
    """The node-side services' clock (plan, watch, steps); sleeping returns at once."""
    fake = SimpleNamespace(monotonic=monotonic, sleep=lambda s: None, time=time.time)
    with contextlib.ExitStack() as stack:
        for module in ("plan", "watch", "steps", "units"):
            stack.enter_context(mock.patch(f"deployments.node.{module}.time", fake))
        yield


def fake_clock(start, step):
    """The plan's own clock, jumping `step` seconds per reading (Redis and asyncio keep the real one)."""
    ticks = itertools.count(start, step)
    return _clock(lambda: next(ticks))


@pytest.fixture
def host(tmp_path, settings):
    settings.VAR_DIR = tmp_path
    with _clock(time.monotonic), FakeHost(tmp_path) as fake:
        yield fake


def _queued(model, node, **kw):
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.QUEUED,
                          engine_args={"tensor-parallel-size": 2, "served-model-name": "tiny"}, env={"NCCL_PROTO": "LL"}, **kw)
    d.gpus.set(node.gpus.filter(index__in=[0, 1]))
    return d


def test_the_plan_stops_the_holder_waits_for_memory_launches_loads_and_smoke_tests(model, node, host):
    holder = DeploymentFactory(node=node, status=S.READY, pid=777, pgid=777, port=9000, name="old")
    holder.gpus.set(node.gpus.filter(index__in=[1]))
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY and d.pid == 4242 and d.load_percent == 100.0
    assert [e.step for e in d.events.all()] == ["model", "checks", "stop_others", "gpu_memory", "launch", "load", "smoke_test"]
    assert all(e.ended for e in d.events.all())
    assert Deployment.objects.get(pk=holder.pk).status == S.STOPPED
    host.mocks["processes.stop"].assert_called_once_with(777, 30.0, 10.0)
    assert "old (SIGTERM in 0.4 s, 1 /dev/shm files removed)" in d.events.get(step="stop_others").message
    host.mocks["gpuwait.wait_memory_released"].assert_called_once_with([0, 1], pids=None,
                                                                      timeout_s=plan.MEMORY_TIMEOUT_S, ignore=set())  # no engine asleep on them
    argv, env = host.spec.argv, host.spec.env
    assert argv[1:3] == ["serve", model.copies.get().path] and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["NCCL_PROTO"] == "LL"
    assert d.smoke["reply"] == "Paris." and "'Paris.' in 0.42 s, 3 tokens" in d.events.get(step="smoke_test").message
    assert "Loading weights took 1.5 seconds" in d.log_tail


def test_gpu_memory_that_never_comes_back_fails_naming_the_pids(model, node, host):
    host.mocks["gpuwait.wait_memory_released"].side_effect = gpu.MemoryNotReleased({31337: 40 * 2**30}, 180)
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "PID 31337 holds 40.0 GiB" in d.status_message
    host.mocks["processes.launch"].assert_not_called()
    assert d.events.get(step="gpu_memory").level == DeploymentEvent.Level.ERROR


def test_a_port_in_use_fails_before_launch(model, node, host):
    host.mocks["processes.port_free"].return_value = False
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "Port 8000 is in use" in d.status_message
    host.mocks["processes.launch"].assert_not_called()


def test_a_stranger_answering_on_the_port_is_not_taken_for_the_engine(model, node, host):
    """A process that took the port before the engine bound it answers /health: the plan names it instead of
    calling the deployment ready (seen in CI: another engine on the same port made a deploy "ready")."""
    import subprocess
    import sys

    stranger = started(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))  # its command line
    try:
        host.mocks["listeners.listening"].return_value = ({stranger.pid}, False)
        d = _queued(model, node)
        plan.deployment_run(d.pk)
        d.refresh_from_db()
    finally:
        stranger.kill()
        stranger.wait()
    assert d.status == S.FAILED
    assert d.status_message.startswith(f"Port 8000 is answered by another process, not this deployment's engine: "
                                       f"PID {stranger.pid}") and "time.sleep(60)" in d.status_message
    assert not d.events.filter(step="smoke_test").exists()


def test_an_engine_process_of_the_deployment_listening_on_the_port_is_its_own(model, node, host):
    import subprocess
    import sys

    procs = []

    def launch(spec):  # the listener: a real process with the engine's environment (its marker)
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                      env={**spec.env, "PATH": "/usr/bin:/bin"}))
        marked(procs[0].pid, spec.env[ownership.MARKER_VAR])  # as a real engine's by the time it answers /health
        host.mocks["listeners.listening"].return_value = ({procs[0].pid}, False)
        return FakeHost.launch(host, spec)

    host.mocks["processes.launch"].side_effect = launch
    d = _queued(model, node)
    try:
        plan.deployment_run(d.pk)
    finally:
        procs[0].kill()
        procs[0].wait()
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    host.mocks["vllm.served_models"].assert_not_called()  # the listener's marker proved it


def test_where_the_listener_cannot_be_read_the_engine_key_decides(model, node, host):
    host.mocks["vllm.served_models"].side_effect = vllm.VllmError("HTTP 401: Unauthorized")
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "Port 8000 answers /health but not with this deployment's engine key" in d.status_message
    assert host.mocks["vllm.served_models"].call_args.kwargs["key"]  # asked with the engine's key


def test_a_plan_does_not_download_a_copy_that_is_being_deleted(model, node, host):
    model.copies.update(state="deleting")
    d = _queued(model, node)
    with mock.patch("deployments.node.steps.model_copy_download", autospec=True) as download:
        plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and f"The model's copy on {node} is deleting" in d.status_message
    download.assert_not_called()
    assert model.copies.get().state == "deleting"


def test_an_engine_that_dies_while_loading_fails_with_its_error(model, node, host):
    def launch(spec):
        handle = FakeHost.launch(host, spec)
        spec.log_path.write_text("ERROR 11-29 13:27:56 [core.py:1512] torch.OutOfMemoryError: CUDA out of memory\n")
        host.alive = False
        return handle

    host.mocks["processes.launch"].side_effect = launch
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "CUDA out of memory" in d.status_message and d.pid is None


def test_a_load_is_stalled_only_when_neither_log_nor_memory_moves(model, node, host):
    host.health_after = 10**9
    with fake_clock(start=1000, step=50):
        d = _queued(model, node, stall_seconds=120)
        plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and d.status_message.startswith("Stalled: neither the log nor GPU memory moved")
    host.mocks["processes.stop"].assert_called_with(4242, 30.0, 10.0)


def test_a_stop_request_during_the_plan_aborts_it(model, node, host):
    d = _queued(model, node)

    def stop_meanwhile(*args, **kw):
        Deployment.objects.filter(pk=d.pk).update(status=S.STOPPING)
        return []  # nothing left holding memory

    host.mocks["gpuwait.wait_memory_released"].side_effect = stop_meanwhile
    plan.deployment_run(d.pk)
    host.mocks["processes.launch"].assert_not_called()
    assert Deployment.objects.get(pk=d.pk).status == S.STOPPING  # the halt task finishes the stop
    watch.deployment_halt(d.pk)
    assert Deployment.objects.get(pk=d.pk).status == S.STOPPED


def test_a_crashed_engine_is_failed_with_its_last_lines_and_restarted_with_backoff(
        model, node, host, tmp_path, sent_tasks):
    log = tmp_path / "crash.log"
    log.write_text("line 1\nRuntimeError: NCCL error: unhandled system error\n")
    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=4242, pgid=4242, log_path=str(log), auto_restart=True)
    host.alive = False
    watch.deployments_watch(node.pk, {})
    d.refresh_from_db()
    assert d.status == S.QUEUED and d.restarts == 1
    assert sent_tasks.commit().one("deployments.deployment_run").options["countdown"] == 10
    failed = d.events.get(step="failed").message
    assert "Crashed: the engine process exited" in failed and "NCCL error" in failed


def test_health_must_fail_three_times_before_a_live_engine_counts_as_crashed(model, node, host):
    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=4242, pgid=4242)
    host.mocks["vllm.health"].side_effect = None
    host.mocks["vllm.health"].return_value = False
    state = {}
    with fake_clock(start=0, step=10):
        for expected in (S.READY, S.READY, S.FAILED):
            watch.deployments_watch(node.pk, state)
            assert Deployment.objects.get(pk=d.pk).status == expected


def test_an_agent_restart_adopts_live_engines_and_fails_dead_ones(model, node, host, sent_tasks):
    ready = DeploymentFactory(model=model, node=node, status=S.READY, pid=1, pgid=1, port=8001)
    loading = DeploymentFactory(model=model, node=node, status=S.LOADING, pid=2, pgid=2, port=8002)
    gone = DeploymentFactory(model=model, node=node, status=S.READY, pid=3, pgid=3, port=8003)
    host.mocks["processes.alive"].side_effect = lambda pid, ct=0.0: pid in (1, 2)
    report = reconcile.deployments_reconcile(node)
    assert report == {"adopted": [ready.name], "following": [loading.name], "failed": [gone.name]}
    assert [(s.name, s.args) for s in sent_tasks.commit()] == [("deployments.deployment_follow", [loading.pk])]
    assert Deployment.objects.get(pk=gone.pk).status == S.FAILED


def test_the_systemd_unit_runs_the_same_engine_and_kills_its_whole_group():
    text = systemd.render_unit(description="vLLM kimi", argv=["/opt/vllm", "serve", "/models/a b", "--port", "8000"],
                               env={"NCCL_PROTO": "LL", "VLLM_X": 'say "hi" 100%'}, log_path="/var/log/k.log")
    assert 'ExecStart="/opt/vllm" "serve" "/models/a b" "--port" "8000"' in text
    assert 'Environment="VLLM_X=say \\"hi\\" 100%%"' in text
    assert "KillMode=control-group" in text and "WantedBy=multi-user.target" in text


def test_persisting_needs_a_node_with_systemd(model, node):
    d = DeploymentFactory(model=model, node=node, status=S.READY)
    with pytest.raises(ServiceError, match="cannot keep engines across reboots"):
        deploys.deployment_persist(d)


def test_persisting_keeps_the_running_engine_and_enables_its_unit_for_the_next_start_without_a_second_load(
        model, node, host, tmp_path):
    """A 36-minute load is not paid twice: the unit is written with the engine's command and marker and enabled, not
    started; the serving engine (PID 4242) is the deployment's until systemd starts the unit's (a boot, a crash)."""
    log = tmp_path / "engine.log"
    log.write_text("Starting vLLM server on http://0.0.0.0:8000\n")
    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=4242, pgid=4242, log_path=str(log), port=8000,
                          marker="7.persist-marker")
    seen = []

    def install_unit(name, text, **kwargs):  # the row as anyone reads it while the unit is written
        seen.append(Deployment.objects.values_list("status", "pid").get(pk=d.pk))
        return 0

    with mock.patch("deployments.host.systemd.install", autospec=True, side_effect=install_unit) as install:
        persist.deployment_persist_here(d.pk)
    assert seen == [(S.READY, 4242)]
    name, text = install.call_args.args[:2]
    assert name == f"vllm-{d.name}.service" and install.call_args.kwargs["start"] is False
    assert "ExecStart=" in text and "--port" in text and "7.persist-marker" in text  # adopted by it after a boot
    d.refresh_from_db()
    assert d.systemd_unit == name and d.pid == 4242 and d.status == S.READY and Path(d.log_path) == log
    assert "keeps serving" in d.events.get(step="persist").message


def test_a_persisted_engine_that_ran_outside_its_unit_and_exited_is_started_through_its_unit(model, node):
    """Systemd never ran the engine that was serving when it was persisted: when it exits, the enabled unit is
    inactive and nothing would start it, so the agent does; the deployment then waits for the unit's engine."""
    from deployments.node import units

    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=None, marker="7.m",
                          systemd_unit="vllm-x.service")
    states = iter([systemd.UnitStatus(0, "", "inactive", "enabled", 0),
                   systemd.UnitStatus(6000, "/system.slice/vllm-x.service", "active", "enabled", 0)])
    with mock.patch("deployments.host.systemd.unit_status", autospec=True, side_effect=lambda name: next(states)), \
         mock.patch("deployments.host.systemd.start", autospec=True) as start:
        units.engine_exited(d)
    start.assert_called_once_with("vllm-x.service")
    d.refresh_from_db()
    assert d.status == S.LOADING and d.events.filter(step="unit_start").exists()


def test_one_watch_pass_reaches_each_kind_of_work_only_when_a_row_has_it(node):
    """The pass reads the node's rows once and skips the crash watch, the unit watch and the queue expiry when
    no row needs them; a row that does needs no second look to be reached."""
    from datetime import timedelta

    from django.utils import timezone

    from deployments.node import units

    def one_pass(state):
        with mock.patch.object(watch, "_crash_watch") as crash, mock.patch.object(units, "units_watch") as unit, \
             mock.patch.object(watch, "expire_queued") as expire:
            watch.deployments_watch(node.pk, state)
        return crash.called, unit.called, expire.called

    later = timezone.now() + timedelta(hours=1)
    DeploymentFactory(node=node, status=S.READY, pid=None)  # nothing of these needs a watch
    DeploymentFactory(node=node, status=S.STARTING, pid=None, systemd_unit="", marker="m")
    DeploymentFactory(node=node, status=S.QUEUED, expires_at=later)
    state = {"units": {99: 0.0}}
    assert one_pass(state) == (False, False, False)
    assert state["units"] == {}  # as the unit watch itself forgets deployments no longer waiting
    DeploymentFactory(node=node, status=S.READY, pid=4242)
    assert one_pass({}) == (True, False, False)
    DeploymentFactory(node=node, status=S.STARTING, pid=None, systemd_unit="vllm-w.service", marker="w")
    assert one_pass({}) == (True, True, False)
    DeploymentFactory(node=node, status=S.QUEUED, expires_at=timezone.now() - timedelta(seconds=1))
    assert one_pass({}) == (True, True, True)


def test_a_deployment_stays_driven_while_any_of_its_plans_runs():
    from deployments.node import lifecycle

    older, newer = lifecycle.driving(7), lifecycle.driving(7)
    assert older.__enter__() and not newer.__enter__()  # a newer plan of the same deployment starts
    older.__exit__(None, None, None)  # the older one ends first
    assert lifecycle.driven(7)
    newer.__exit__(None, None, None)
    assert not lifecycle.driven(7)
    with lifecycle.driving(7) as again:
        assert again


def test_a_follow_of_a_deployment_its_plan_drives_returns_at_once(model, node, host):
    from deployments.node import lifecycle

    d = DeploymentFactory(model=model, node=node, status=S.LOADING, pid=4242, pgid=4242, port=8000)
    with lifecycle.driving(d.pk), mock.patch("deployments.node.plan._follow", autospec=True) as follow:
        plan.deployment_follow(d.pk)
    follow.assert_not_called()
    with mock.patch("deployments.node.plan._follow", autospec=True) as follow:
        plan.deployment_follow(d.pk)
    follow.assert_called_once()


class _Metrics(BaseHTTPRequestHandler):
    """vLLM's /metrics with two engines; each read finds 400 more tokens generated."""

    generated = 100

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = (f'vllm:num_requests_running{{engine="0"}} 2.0\nvllm:num_requests_running{{engine="1"}} 1.0\n'
                f'vllm:num_requests_waiting{{engine="0"}} 4.0\nvllm:kv_cache_usage_perc{{engine="0"}} 0.25\n'
                f'vllm:kv_cache_usage_perc{{engine="1"}} 0.75\n'
                f'vllm:generation_tokens_total{{engine="0"}} {type(self).generated}.0\n').encode()
        type(self).generated += 400
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_engine_figures_are_published_with_tok_s_from_the_counters_rise(model, node):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=4242, pgid=4242, port=server.server_address[1])
    state = {}
    try:
        with fake_clock(start=0, step=2):
            watch.deployments_metrics(node.pk, state)
            assert not [m for m in snapshots.snapshot(payloads.deployment_topic(d.pk)) if m["kind"] == "engine"]
            watch.deployments_metrics(node.pk, state)
    finally:
        server.shutdown()
        server.server_close()
    [message] = [m for m in snapshots.snapshot(payloads.deployment_topic(d.pk)) if m["kind"] == "engine"]
    at = message["data"].pop("at")
    assert abs(at - time.time()) < 60  # Unix time of the reading
    # The server counts no TTFT or finished request: the SLO figures of its 2-second window are empty.
    assert message["data"] == {"id": d.pk, "name": d.name, "tok_s": 200.0, "running": 3.0, "waiting": 4.0,
                               "kv_cache": 0.75, "ttft_p95_s": None, "error_share": None, "refused": 0, "window_requests": 0,
                               "window_s": 2}
