"""Touch only what the panel owns: markers, foreign GPU holders, claims, model files, systemd units,
and rows that end in the true state after faults. Each test reproduces a finding.

Processes here are real (`sleep` in its own session): ownership is read from /proc."""
import os
import re
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
from django.utils import timezone

from deployments.host import ownership, processes, store
from deployments.models import Deployment, DeploymentEvent, ModelCopy, Node
from deployments.node import plan, reconcile, watch
from deployments.services import deploys, nodes, repos
from plumbing.errors import ServiceError
from tests.deployments.test_deploys import _create, _queued, host, model, node  # noqa: F401
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory
from tests.helpers import marked, started

pytestmark = pytest.mark.django_db
S = Deployment.Status


@pytest.fixture
def sleeper():
    """An unrelated process group (someone else's job), running `sleep` (exec'd: what /proc shows of it is its
    own), killed by the test itself at the end."""
    procs = []

    def start(env=None):
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True, env=env)
        procs.append(proc)
        return started(proc)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _alive(proc) -> bool:
    return proc.poll() is None


# --- 1. ownership you can prove ----------------------------------------------------------------

def test_a_stored_pgid_now_naming_someone_elses_process_is_never_signalled(sleeper):
    stranger = sleeper()
    d = DeploymentFactory(status=S.STOPPING, pid=stranger.pid, pgid=stranger.pid, marker="1.deadbeef")
    watch.deployment_halt(d.pk)
    time.sleep(0.2)
    assert _alive(stranger)
    d.refresh_from_db()
    assert d.status == S.STOPPED and d.pgid is None
    warning = d.events.get(step="not_signalled")
    assert str(stranger.pid) in warning.message and warning.level == DeploymentEvent.Level.WARNING


def test_a_row_from_before_markers_proves_nothing_and_is_not_signalled(sleeper):
    stranger = sleeper()
    d = DeploymentFactory(status=S.READY, pid=stranger.pid, pgid=stranger.pid, marker="")
    watch.deployments_watch(d.node_id, {})
    assert _alive(stranger)
    assert Deployment.objects.get(pk=d.pk).status == S.FAILED  # the engine is not there: the true state


def test_an_engine_carrying_its_marker_is_stopped_with_its_whole_group(sleeper):
    marker = ownership.new_marker(7)
    ours = sleeper(env={**os.environ, ownership.MARKER_VAR: marker})
    d = DeploymentFactory(status=S.STOPPING, pid=ours.pid, pgid=ours.pid, marker=marker)
    marked(ours.pid, marker)  # what the agent reads once an engine runs (CI read an environment not laid out yet)
    assert ownership.owned(ours.pid, marker) and not ownership.owned(ours.pid, "7.other")
    watch.deployment_halt(d.pk)
    ours.wait(5)
    assert Deployment.objects.get(pk=d.pk).status == S.STOPPED


def test_the_panel_sets_the_marker_and_pci_bus_order_itself(model, node, host):
    d = _queued(model, node)
    Deployment.objects.filter(pk=d.pk).update(env={ownership.MARKER_VAR: "forged"})
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert host.spec.env[ownership.MARKER_VAR] == d.marker and d.marker.startswith(f"{d.pk}.")
    assert host.spec.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_crashed_engines_shm_files_are_removed_when_the_panel_learns_it_died(tmp_path):
    left = Path("/dev/shm") / f"psm_paneltest_{os.getpid()}"
    left.write_bytes(b"x")
    d = DeploymentFactory(status=S.READY, pid=2 ** 22 + 1, pgid=2 ** 22 + 1, marker="1.x", shm_files=[str(left)])
    watch.deployments_watch(d.node_id, {})
    assert not left.exists() and Deployment.objects.get(pk=d.pk).status == S.FAILED


def test_shm_paths_from_the_database_outside_dev_shm_are_never_deleted(tmp_path):
    victim = tmp_path / "keep"
    victim.write_text("x")
    assert processes.remove_unused_shm({str(victim), f"/dev/shm/../{victim}"}) == [] and victim.exists()


# --- 2. foreign GPU holders are the operator's call -------------------------------------------

def _holder(pid, memory=2 << 30):
    from deployments.host import gpu
    return {0: [gpu.GpuProcess(pid=pid, used_memory=memory, name="python")]}


def test_a_foreign_process_on_the_gpus_fails_the_plan_naming_it_and_is_not_signalled(model, node, host, sleeper):
    stranger = sleeper()
    d = _queued(model, node)
    host.mocks["gpu.processes_on"].return_value = _holder(stranger.pid)
    plan.deployment_run(d.pk)
    stops = host.mocks["processes.stop"].call_args_list
    d.refresh_from_db()
    assert d.status == S.FAILED and f"PID {stranger.pid}" in d.status_message and "2048 MiB" in d.status_message
    assert not stops and _alive(stranger)


def test_with_the_checkbox_foreign_processes_are_stopped_but_never_a_display_server(model, node, host, sleeper):
    stranger, xorg = sleeper(), sleeper()
    d = _queued(model, node, stop_foreign=True)
    real_describe = ownership.describe

    def describe(pid):
        return {**real_describe(pid), "name": "Xorg"} if pid == xorg.pid else real_describe(pid)

    with mock.patch("deployments.host.ownership.describe", side_effect=describe):
        held = _holder(stranger.pid)
        held[0] += _holder(xorg.pid)[0]
        host.mocks["gpu.processes_on"].return_value = held
        plan.deployment_run(d.pk)
    stranger.wait(5)  # signalled itself (exactly the holders, not their groups)
    assert _alive(xorg) and f"PID {xorg.pid}" not in Deployment.objects.get(pk=d.pk).events.get(step="stop_others").message
    assert Deployment.objects.get(pk=d.pk).status == S.READY


def test_the_api_answers_409_naming_foreign_processes_unless_asked_to_stop_them(model, node, operator, sent_tasks):
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(operator)
    Node.objects.filter(pk=node.pk).update(foreign_processes=[
        {"pid": 4321, "user": "alice", "command": "python train.py", "name": "python", "memory": 40 << 30,
         "gpus": [1], "display": False}])
    body = {"model": model.pk, "node": node.name, "gpus": [0, 1], "port": 8000, "engine_args": {"tensor-parallel-size": 2}}
    refused = api.post("/api/deployments/", body, format="json")
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "foreign_processes" and "PID 4321 (alice: python train.py, 40960 MiB)" in error["message"]
    assert error["processes"][0]["pid"] == 4321
    accepted = api.post("/api/deployments/", {**body, "stop_foreign": True}, format="json")
    assert accepted.status_code == 202 and accepted.json()["stop_foreign"] is True


# --- 3. GPU claims ----------------------------------------------------------------------------

def test_on_a_host_without_gpus_the_whole_host_is_the_claim(sent_tasks):
    cpu = NodeFactory(name="cpu-01")
    copy = ModelCopyFactory(node=cpu, model=ModelRepoFactory(files=[{"path": "a", "size": 1}]))
    DeploymentFactory(node=cpu, status=S.LOADING, name="first", port=9000)
    with pytest.raises(ServiceError, match="first is loading") as exc:
        _create(copy.model, cpu, gpu_indices=[], engine_args={})
    assert exc.value.code == "gpus_busy"


def test_restarting_another_deployment_onto_claimed_gpus_is_refused(model, node, sent_tasks):
    first = _create(model, node)
    second = DeploymentFactory(node=node, model=model, status=S.STOPPED, port=9001, name="second")
    second.gpus.set(node.gpus.filter(index__in=[1]))
    with pytest.raises(ServiceError, match=f"{first.name} is queued") as exc:
        deploys.deployment_redeploy(second)
    assert exc.value.code == "gpus_busy"


def test_an_auto_restart_never_lands_on_gpus_someone_took_meanwhile(model, node):
    crashed = DeploymentFactory(node=node, model=model, status=S.READY, pid=2 ** 22 + 3, pgid=2 ** 22 + 3,
                                marker="1.x", auto_restart=True, port=9002, name="crashy")
    crashed.gpus.set(node.gpus.filter(index__in=[3]))
    taker = DeploymentFactory(node=node, model=model, status=S.LOADING, port=9003, name="taker")
    taker.gpus.set(node.gpus.filter(index__in=[3]))  # e.g. claimed while `crashy` was failed between restarts
    watch.deployments_watch(node.pk, {})
    crashed.refresh_from_db()
    assert crashed.status == S.FAILED and crashed.restarts == 0
    assert "taker uses its GPUs" in crashed.events.filter(step="auto_restart").last().message


def test_the_launch_step_refuses_when_another_deployment_holds_the_gpus(model, node, host):
    d = _queued(model, node)
    other = DeploymentFactory(node=node, model=model, status=S.STARTING, port=9004, name="sneaky")
    other.gpus.set(node.gpus.filter(index__in=[0]))
    with mock.patch("deployments.node.plan._stop_holders", return_value="skipped"):
        plan.deployment_run(d.pk)
    assert not host.mocks["processes.launch"].called
    d.refresh_from_db()
    assert d.status == S.FAILED and "sneaky (starting) holds GPUs 0, 1" in d.status_message


# --- 4. model files ---------------------------------------------------------------------------

def test_revisions_that_look_alike_never_share_a_folder():
    pairs = [("org/m", "a/b"), ("org/m", "a_b"), ("org/m", "a b"), ("org--m/x", "main"), ("org/m--x", "main"),
             ("org/m", "main"), ("org/m", "v1.0")]
    folders = {store.model_dir("/s", repo, rev) for repo, rev in pairs}
    assert len(folders) == len(pairs)
    assert store.model_dir("/s", "org/m", "main") == Path("/s/org--m")  # existing names do not move


def test_a_deploy_of_a_copy_being_deleted_is_refused(model, node, sent_tasks):
    ModelCopy.objects.filter(model=model, node=node).update(state=ModelCopy.State.DELETING)
    with pytest.raises(ServiceError, match="being deleted") as exc:
        _create(model, node)
    assert exc.value.code == "in_use"


def test_removal_never_runs_under_an_engine_that_uses_the_folder(model, node, tmp_path):
    copy = ModelCopy.objects.get(model=model, node=node)
    folder = Path(copy.path)
    folder.mkdir(parents=True)
    (folder / "w.safetensors").write_bytes(b"w")
    ModelCopy.objects.filter(pk=copy.pk).update(state=ModelCopy.State.DELETING)
    DeploymentFactory(node=node, model=model, status=S.LOADING, port=9005)
    assert repos.model_copy_remove(copy.pk) == 0
    assert (folder / "w.safetensors").exists() and ModelCopy.objects.get(pk=copy.pk).state == ModelCopy.State.READY


def test_stopping_a_persisted_deployment_disables_its_unit_and_starting_enables_it(model, node, host):
    d = DeploymentFactory(node=node, model=model, status=S.STOPPING, systemd_unit="vllm-x.service", port=9006)
    with mock.patch("deployments.host.systemd.systemctl", autospec=True) as systemctl, \
            mock.patch("deployments.host.systemd.install", autospec=True, return_value=os.getpid()) as install:
        watch.deployment_halt(d.pk)
        assert systemctl.call_args_list == [mock.call("disable", "--now", "vllm-x.service")]
        q = _queued(model, node, systemd_unit="vllm-y.service", name="y")
        plan.deployment_run(q.pk)
    assert Deployment.objects.get(pk=q.pk).status == S.READY
    name, text = install.call_args.args
    assert name == "vllm-y.service" and f"{ownership.MARKER_VAR}=" in text and "CUDA_DEVICE_ORDER" in text


# --- 5. faults end in the true state -----------------------------------------------------------

def test_any_exception_mid_plan_ends_failed_with_the_engine_stopped(model, node, host):
    from django.db import OperationalError

    d = _queued(model, node)
    with mock.patch("deployments.host.processlog.read_lines", side_effect=OperationalError("server closed the connection")):
        plan.deployment_run(d.pk)
        stopped = [c.args[0] for c in host.mocks["processes.stop"].call_args_list]
    d.refresh_from_db()
    assert d.status == S.FAILED and "OperationalError" in d.status_message and stopped == [4242]


def test_a_plan_the_node_never_started_in_time_ends_saying_nothing_was_done():
    d = DeploymentFactory(status=S.QUEUED, expires_at=timezone.now() - timedelta(seconds=1))
    fresh = DeploymentFactory(node=d.node, status=S.QUEUED, expires_at=timezone.now() + timedelta(minutes=5), port=9007)
    reconcile.deployments_reconcile(d.node)
    d.refresh_from_db()
    assert d.status == S.FAILED and "node was offline); nothing was done" in d.status_message
    assert Deployment.objects.get(pk=fresh.pk).status == S.QUEUED


def test_a_plan_is_queued_with_an_expiry(model, node, sent_tasks, settings):
    settings.HOST_TASK_EXPIRES_S = 120
    d = _create(model, node)
    assert sent_tasks.commit().one("deployments.deployment_run").options["expires"] == 120
    assert 100 < (d.expires_at - timezone.now()).total_seconds() <= 120


def test_live_updates_never_fail_the_caller_while_redis_is_away():
    import redis
    from channels_redis.core import RedisChannelLayer

    from plumbing.live import publishing

    dead = "redis://127.0.0.1:9/0"  # nothing listens on the discard port
    with mock.patch("plumbing.redisconn.client", return_value=redis.Redis.from_url(dead)), \
            mock.patch("plumbing.live.sender.get_channel_layer", return_value=RedisChannelLayer(hosts=[dead])):
        publishing.publish("node:1", "status", {"x": 1})  # logged, not raised


def test_a_second_agent_under_a_name_that_heartbeats_refuses_to_start(sleeper):
    kw = dict(name="gpu-07", address="", agent_version="t", model_store="/m", heartbeat_seconds=5, gpus=[])
    nodes.node_register(**kw, agent_host="host-a", agent_pid=os.getpid())
    with pytest.raises(nodes.AgentConflict, match="already has a running agent"):
        nodes.node_register(**kw, agent_host="host-b", agent_pid=1234)
    # the same host's agent killed a moment ago (its PID is gone): the restart goes ahead
    node = Node.objects.get(name="gpu-07")
    serving = DeploymentFactory(node=node, status=S.READY, name="serving-on-07", port=9010)
    heard = timezone.now() - timedelta(seconds=7)
    Node.objects.filter(name="gpu-07").update(agent_pid=2 ** 22 + 5, last_heartbeat=heard)
    assert nodes.node_register(**kw, agent_host="host-a", agent_pid=4321).agent_pid == 4321
    # Its deployments' timelines say the agent was lost and when the new one took over: the outage is the agent's.
    event = serving.events.get(step="agent")
    assert event.level == "warning" and event.message.startswith(
        f"The node agent (PID {2 ** 22 + 5}) was lost after its last heartbeat at {heard:%H:%M:%S}; a new agent "
        f"(PID 4321) took over at ")
    later = re.search(r", (\d+) s later\. The engine was not stopped\.$", event.message)
    assert later and int(later.group(1)) >= 7, event.message
    nodes.node_register(**kw, agent_host="host-a", agent_pid=4321)  # the same agent registering again: nothing lost
    assert serving.events.filter(step="agent").count() == 1


def test_a_download_whose_row_stopped_moving_is_queued_again(sent_tasks):
    copy = ModelCopyFactory(state=ModelCopy.State.DOWNLOADING)
    ModelCopy.objects.filter(pk=copy.pk).update(updated=timezone.now() - timedelta(minutes=5))
    moving = ModelCopyFactory(node=copy.node, state=ModelCopy.State.DOWNLOADING)
    assert repos.model_copies_stalled_resume(copy.node_id) == [copy.pk]
    assert sent_tasks.commit()[-1].args == [copy.pk] and moving.pk not in repos.model_copies_stalled_resume(copy.node_id)


def test_deleting_a_persisted_deployment_removes_its_unit_on_the_node_first(model, node, sent_tasks):
    d = DeploymentFactory(node=node, model=model, status=S.STOPPED, systemd_unit="vllm-gone.service", port=9008)
    assert deploys.deployment_delete(d) is False  # the node removes the unit, then the row
    assert sent_tasks.commit()[-1].args == [d.pk] and Deployment.objects.filter(pk=d.pk).exists()
    with mock.patch("deployments.host.systemd.systemctl", autospec=True) as systemctl:
        watch.deployment_forget(d.pk)
    assert mock.call("disable", "--now", "vllm-gone.service") in systemctl.call_args_list
    assert not Deployment.objects.filter(pk=d.pk).exists()


def test_a_running_deployment_cannot_be_deleted_and_a_plain_one_goes_at_once(model, node):
    running = DeploymentFactory(node=node, model=model, status=S.READY, port=9009)
    with pytest.raises(ServiceError, match="stop it first") as exc:
        deploys.deployment_delete(running)
    assert exc.value.code == "busy"
    stopped = DeploymentFactory(node=node, model=model, status=S.FAILED, port=9010)
    assert deploys.deployment_delete(stopped) is True and not Deployment.objects.filter(pk=stopped.pk).exists()


def test_an_agent_restart_sends_again_the_plans_it_had_taken_but_not_started(model, node, sent_tasks):
    d = DeploymentFactory(node=node, model=model, status=S.QUEUED, port=9011,
                          expires_at=timezone.now() + timedelta(minutes=5))
    reconcile.deployments_reconcile(node)
    assert [(s.name, s.args) for s in sent_tasks.commit()] == [("deployments.deployment_run", [d.pk])]
