"""PID reuse, a foreign process on the host, 50 concurrent claims on the same GPUs, and a delete
racing a deploy: real agents, real processes, the real API over HTTP."""
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from deployments.models import Deployment, ModelCopy, ModelRepo
from deployments.node import watch
from deployments.services import deploys, repos
from plumbing.errors import ServiceError
from tests.conftest import wait_until
from tests.helpers import api_client
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory, UserFactory
from tests.faults.conftest import RACES, sha256
from tests.truestate import (COUNTS, Agent, add_fake_model, agent_env, assert_true_state, deploy, random_moment,
                             set_load, settle, stop_and_check, stop_leftover_engines)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
S = Deployment.Status
SCOPED_AGENT = Path(__file__).parent / "scoped_agent.py"
SYSTEMD_DOUBLE = Path(__file__).parent / "systemd"


def _cpu_deploy(model, node) -> dict:
    """A deploy request on the node without GPUs, on a port of this test process's own."""
    return {"model": model.pk, "node": node.name, "gpus": [], "port": 18000 + os.getpid() % 1000}


@pytest.fixture
def stranger():
    """`setsid sleep`: someone else's process group, which the panel must never signal."""
    # Not started as a group leader, so setsid(1) makes the new session itself and execs sleep
    # under the same PID (as a leader it would fork and exit at once).
    proc = subprocess.Popen(["setsid", "sleep", "600"])
    wait_until(lambda: os.getpgid(proc.pid) == proc.pid, timeout=5, message="setsid")
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.timeout(120)
def test_a_stored_pgid_reused_by_an_unrelated_process_is_never_signalled(fault_agent, fake_model, stranger):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    # Rows whose stored PID/PGID now name the stranger (after a reboot or PID reuse), in each state
    # the agent acts on: ready (crash watch), stopping (halt), loading (reconcile at agent start).
    ready = DeploymentFactory(node=node, model=model, status=S.READY, pid=stranger.pid, pgid=stranger.pid,
                              marker="1.0123456789abcdef01234567", port=9101, name="reused-ready")
    stopping = DeploymentFactory(node=node, model=model, status=S.STOPPING, pid=stranger.pid, pgid=stranger.pid,
                                 marker="2.0123456789abcdef01234567", port=9102, name="reused-stopping")
    watch.deployment_halt(stopping.pk)  # what the agent's halt task runs
    settle(ready, timeout=30, states={"failed"})  # the crash watch: the engine is not there
    loading = DeploymentFactory(node=node, model=model, status=S.LOADING, pid=stranger.pid, pgid=stranger.pid,
                                marker="", port=9103, name="reused-loading")
    fault_agent.restart()  # reconcile at start
    settle(loading, timeout=30, states={"failed"})
    COUNTS["pid_reuse_cases"] += 3
    assert stranger.poll() is None, "the unrelated process group was signalled"
    assert Deployment.objects.get(pk=stopping.pk).status == S.STOPPED
    for d in (ready, stopping, loading):
        assert d.events.filter(step="not_signalled").exists(), d.name


@pytest.mark.timeout(120)
def test_a_foreign_engine_holding_the_cpu_host_is_refused_without_the_checkbox_and_stopped_with_it(
        process_env, spawn, unique, tmp_path, fake_model, operator):
    """On a host without GPUs the whole host is the claim: a vLLM the panel did not start holds it.
    The agent sees only this test's foreign engine (tests/faults/scoped_agent.py): the checkbox path
    stops what it sees, and other sessions' engines on a shared machine must not be among them."""
    scope = f"foreign-{unique}"
    env = agent_env(process_env, tmp_path, CPU_HOST_EXCLUSIVE=1, FAULT_SCOPE=scope)
    agent = Agent(spawn, env, f"foreign-{unique}", tmp_path / "store", script=SCOPED_AGENT)
    node = agent.start()
    model = add_fake_model(node, fake_model)
    foreign = subprocess.Popen(["bash", "-c", 'exec -a "vllm serve someone-elses-model" sleep 600'],
                               env={**os.environ, "FAULT_SCOPE": scope}, start_new_session=True)
    try:
        wait_until(lambda: [p["pid"] for p in type(node).objects.get(pk=node.pk).foreign_processes] == [foreign.pid],
                   timeout=30, message="the agent to see the foreign engine, and only it")
        api, body = api_client(operator), _cpu_deploy(model, node)
        refused = api.post("/api/deployments/", body, format="json")
        assert refused.status_code == 409, refused.json()
        assert f"PID {foreign.pid}" in refused.json()["error"]["message"]
        assert foreign.poll() is None
        # The plan itself checks too (the API's view of the host may be seconds old).
        d = Deployment.objects.create(name=f"sneak-{unique}", model=model, node=node, port=body["port"] + 1)
        deploys.send_plan(d)
        row = settle(d, timeout=30, states={"failed"})
        assert f"PID {foreign.pid}" in row.status_message and foreign.poll() is None
        COUNTS["foreign_refusals"] += 2
        # With "stop other processes on these GPUs" the operator takes the call: it is stopped.
        accepted = api.post("/api/deployments/", {**body, "stop_foreign": True}, format="json")
        assert accepted.status_code == 202, accepted.json()
        d = Deployment.objects.get(pk=accepted.json()["id"])
        assert settle(d, timeout=60).status == "ready", Deployment.objects.get(pk=d.pk).status_message
        wait_until(lambda: foreign.poll() is not None, timeout=5, message="the foreign engine to be stopped")
        assert d.events.filter(step="stop_others", message__contains=f"PID {foreign.pid}").exists()
        COUNTS["foreign_stops"] += 1
        stop_and_check(d, fake_model)
    finally:
        if foreign.poll() is None:
            foreign.kill()
        foreign.wait()
        stop_leftover_engines(tmp_path)


class _SystemdUnit:
    """Someone's engine as a unit of the systemctl double (tests/faults/systemd: its process in /system.slice/NAME, as
    systemd runs it), Restart=always."""

    def __init__(self, tmp_path, unique, scope):
        self.name = f"minimax-{unique}.service"
        self.env = {"PATH": f"{SYSTEMD_DOUBLE}:{os.environ['PATH']}", "SYSTEMD_UNIT_PATH": str(tmp_path / "units"),
                    "SYSTEMCTL_DOUBLE_STATE": str(tmp_path / "systemd-state")}
        (tmp_path / "units").mkdir()
        (tmp_path / "units" / self.name).write_text(
            "[Service]\nExecStart=/bin/bash -c 'exec -a \"vllm serve minimax\" sleep 600'\n"
            f"Environment=FAULT_SCOPE={scope}\nRestart=always\nRestartSec=0.3\n")
        self._systemctl("start", self.name)
        self.supervisor = {"kind": "systemd", "name": self.name, "restart": "always"}
        self.named, self.stopped_by = f"systemd unit {self.name}, restart always", f"systemctl stop {self.name}"

    def _systemctl(self, *args) -> str:
        return subprocess.run(["python3", str(SYSTEMD_DOUBLE / "systemctl"), *args], env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=60).stdout.strip()

    def main_pid(self) -> int:
        return int(self._systemctl("show", "-p", "MainPID", "--value", self.name) or 0)

    def down(self) -> bool:
        return self._systemctl("show", "-p", "ActiveState", "--value", self.name) == "inactive" and not self.main_pid()

    def remove(self) -> None:
        self._systemctl("stop", self.name)


class _Container:
    """Someone's engine as a container of the Docker API double (tests/dockerd.py: its process in
    docker-<id>.scope, as Docker's systemd cgroup driver puts it), restart policy "always"."""

    def __init__(self, tmp_path, unique, scope):
        import docker

        from tests import dockerd

        self._daemon = dockerd.running(tmp_path / "dockerd")
        self.env = {"DOCKER_HOST": self._daemon.__enter__()}
        self._client = docker.DockerClient(base_url=self.env["DOCKER_HOST"], version=dockerd.API_VERSION, timeout=30)
        self._c = self._client.containers.run("someone/minimax", ["/bin/bash", "-c", 'exec -a "vllm serve minimax" sleep 600'],
                                              environment={"FAULT_SCOPE": scope}, detach=True,
                                              restart_policy={"Name": "always"})
        self.supervisor = {"kind": "container", "name": self._c.id, "restart": "always"}
        self.named, self.stopped_by = f"container {self._c.id[:12]}, restart always", f"docker stop {self._c.id[:12]}"

    def main_pid(self) -> int:
        self._c.reload()
        return int(self._c.attrs["State"]["Pid"] or 0)

    def down(self) -> bool:
        return not self.main_pid()

    def remove(self) -> None:
        self._daemon.__exit__(None, None, None)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("supervised", [_SystemdUnit, _Container], ids=["systemd", "docker"])
def test_a_foreign_engine_under_a_supervisor_that_restarts_it_is_named_with_it_and_stopped_through_it(
        supervised, process_env, spawn, unique, tmp_path, fake_model, operator):
    """Someone's MiniMax under a systemd unit with Restart=always, or in a container with restart policy "always": a
    SIGTERM by PID sees it back a moment later. The refusal names the unit or container; with consent the plan stops
    it through its manager (`systemctl stop`, the Docker API's stop), and it stays down."""
    scope = f"sup-{unique}"
    foreign = supervised(tmp_path, unique, scope)
    try:
        agent = Agent(spawn, agent_env(process_env, tmp_path, CPU_HOST_EXCLUSIVE=1, FAULT_SCOPE=scope, **foreign.env),
                      f"sup-{unique}", tmp_path / "store", script=SCOPED_AGENT)
        node = agent.start()
        model = add_fake_model(node, fake_model)
        seen = wait_until(lambda: (f := type(node).objects.get(pk=node.pk).foreign_processes) and f, timeout=30,
                          message="the agent to see the supervised engine")
        assert [(p["pid"], p["supervisor"]) for p in seen] == [(foreign.main_pid(), foreign.supervisor)]
        api, body = api_client(operator), _cpu_deploy(model, node)
        refused = api.post("/api/deployments/", body, format="json")
        assert refused.status_code == 409, refused.json()
        assert foreign.named in refused.json()["error"]["message"]
        accepted = api.post("/api/deployments/", {**body, "stop_foreign": True}, format="json")
        assert accepted.status_code == 202, accepted.json()
        d = Deployment.objects.get(pk=accepted.json()["id"])
        assert settle(d, timeout=60).status == "ready", Deployment.objects.get(pk=d.pk).status_message
        assert d.events.filter(step="stop_others", message__contains=foreign.stopped_by).exists(), \
            list(d.events.values_list("step", "message"))
        time.sleep(1.0)  # past the restart delays: a restart, had it been signalled by PID, would be here
        assert foreign.down(), "its supervisor brought the engine back"
        COUNTS["foreign_stops"] += 1
        stop_and_check(d, fake_model)
    finally:
        foreign.remove()
        stop_leftover_engines(tmp_path)


@pytest.mark.postgres_only  # SQLite has no concurrent row locks: it serializes every write
@pytest.mark.timeout(180)
def test_fifty_concurrent_deploys_and_restarts_on_the_same_gpus_accept_exactly_one(live_server_asgi, operator):
    from plumbing import tokens

    node = NodeFactory(name="race-01", engine_flags=["--port", "--host"])
    for i in range(2):
        GpuFactory(node=node, index=i)
    copy = ModelCopyFactory(node=node, path="/models/race", state="ready")
    stopped = [DeploymentFactory(node=node, model=copy.model, status=S.STOPPED, port=9200 + i, name=f"race-{i}")
               for i in range(25)]
    for d in stopped:
        d.gpus.set(node.gpus.all())
    token = tokens.issue(operator)
    barrier = threading.Barrier(50)

    def request(i):
        with httpx.Client(base_url=live_server_asgi, headers={"Authorization": f"Token {token}"}, timeout=60) as client:
            barrier.wait()
            if i % 2:
                return client.post(f"/api/deployments/{stopped[i // 2].pk}/restart/", json={}).status_code
            return client.post("/api/deployments/", json={"model": copy.model.pk, "node": node.name, "gpus": [0, 1],
                                                          "port": 9300 + i}).status_code

    with ThreadPoolExecutor(50) as pool:
        codes = list(pool.map(request, range(50)))
    COUNTS["concurrent_claims"] += 50
    assert sorted(codes) == [202] + [409] * 49, codes
    claims = Deployment.objects.filter(node=node, status__in=Deployment.ACTIVE)
    assert claims.count() == 1


@pytest.mark.timeout(120 + 30 * RACES)
def test_a_delete_racing_a_deploy_has_exactly_one_winner_with_its_files_intact(fault_agent, fake_model):
    node = fault_agent.node
    set_load(fake_model, 0.2)
    winners = []
    for i in range(RACES):
        # A copy in the node's model store (a local folder would only be forgotten, never deleted).
        store_dir = fault_agent.store / f"acme--race-{i}"
        shutil.copytree(fake_model, store_dir)
        before = {p.name: sha256(p) for p in store_dir.iterdir() if p.is_file()}
        # No Hub file list: once the copy is gone the model cannot be downloaded again here, so a deploy
        # decided after the whole removal (the agent may finish it before the deploy thread even runs on
        # a loaded machine) is refused as well, instead of planning a fresh download.
        model = ModelRepo.objects.create(repo_id=f"acme/race-{i}", inspected=timezone.now(), files=[])
        copy = ModelCopy.objects.create(model=model, node=node, state="ready", path=str(store_dir))
        barrier = threading.Barrier(2)
        results = {}
        delays = random_moment(0, 0.02), random_moment(0, 0.02)  # either may get there first (drawn here: in order)

        def deleting():
            barrier.wait()
            time.sleep(delays[0])
            try:
                repos.model_copy_delete(ModelCopy.objects.get(pk=copy.pk))
                results["delete"] = "won"
            except ServiceError as exc:
                results["delete"] = exc.code
            finally:
                connection.close()

        def deploying():
            barrier.wait()
            time.sleep(delays[1])
            try:
                results["deploy"] = deploy(model, node).pk
            except ServiceError as exc:
                results["deploy"] = exc.code
            finally:
                connection.close()

        threads = [threading.Thread(target=deleting), threading.Thread(target=deploying)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        COUNTS["delete_deploy_races"] += 1
        if results["delete"] == "won":
            # in_use: decided while the copy was being deleted; not_inspected: after its row was gone.
            assert results["deploy"] in ("in_use", "not_inspected"), results
            winners.append("delete")
            wait_until(lambda: not ModelCopy.objects.filter(pk=copy.pk).exists(), timeout=30, message="the removal")
            assert not store_dir.exists(), "a half-deleted folder"
        else:
            assert results["delete"] == "in_use" and isinstance(results["deploy"], int), results
            winners.append("deploy")
            d = Deployment.objects.get(pk=results["deploy"])
            assert settle(d, timeout=30).status == "ready"
            assert {p.name: sha256(p) for p in store_dir.iterdir() if p.is_file()} == before
            stop_and_check(d, store_dir)
    print(f"delete/deploy races: {RACES}, winners {winners}")
