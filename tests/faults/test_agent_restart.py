"""Upgrading the node agent keeps engines running: restart the agent while a deployment serves and a request
stream runs against its engine, AGENT_RESTARTS times; the engine keeps answering (no request of the stream
fails), and each new agent adopts it (the deployment stays ready, with the same engine, and only one).

Two production paths, each run for real:
- compose: the agent is a container (of the Docker Engine API double, tests/dockerd.py, which kills the whole
  container's cgroup on a stop, as Docker does) and starts engines as containers of their own
  (PANEL_ENGINE_RUNTIME=docker, through the real `docker` SDK); `docker restart` of the agent container.
  Its control: with engines as the agent's own processes (PANEL_ENGINE_RUNTIME=process, the old compose
  path), the same restart takes the engine down, which is why compose uses the container runtime.
- `./panel start` (panelctl.launcher): Ctrl-C, then start again, as an upgrade does; engines run in
  sessions of their own on the host and the launcher stops only its own children.
The engine is tests/faults/fakevllm (a real vLLM adds nothing here: what survives is a process, not a model)."""
import os
import signal
import sys
import threading
import time

import httpx
import pytest

from deployments import engineapikey
from deployments.host import containers, keepers, processes, vllm
from deployments.models import Deployment, DeploymentEvent, Node
from deployments.services import deploys
from tests import dockerd
from tests.conftest import ROOT, agent_argv, free_port, wait_until
from tests.truestate import COUNTS, add_fake_model, agent_env, assert_true_state, deploy, set_load, settle, stop_and_check

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
RESTARTS = int(os.environ.get("FAULT_AGENT_RESTARTS", "2"))
STOP_GRACE_S = 5  # `docker restart -t`: SIGTERM, then SIGKILL of the whole container


class RequestStream:
    """Chat completions sent one after another to an engine from a thread, each outcome kept with its times."""

    def __init__(self, port: int, model: str, key: str):
        self.url, self.model = f"http://127.0.0.1:{port}/v1/chat/completions", model
        self.headers = vllm.auth_headers(key)  # the engine's own key, as the panel and its gateway send it
        self.done: list[tuple[float, float]] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10, headers=self.headers) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    reply = client.post(self.url, json={"model": self.model, "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": "hi"}]})
                    reply.raise_for_status()
                    # A finished choice is an answer (a random test model may well answer "")
                    assert reply.json()["choices"][0]["finish_reason"]
                    self.done.append((started, time.monotonic()))
                except Exception as exc:  # noqa: BLE001 - every failure is the finding
                    self.failed.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
                time.sleep(0.02)

    def answered_between(self, start: float, end: float) -> int:
        return sum(1 for began, ended in self.done if began >= start and ended <= end)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(15)


class AgentContainer:
    """`manage.py nodeagent` as a container of the double, as compose runs it (restart: stop, then start)."""

    def __init__(self, docker_host: str, env: dict, name: str, store, restart: str = "no"):
        import docker

        self.client = docker.DockerClient(base_url=docker_host, version=dockerd.API_VERSION, timeout=30)
        self.name, self.env = name, {**env, "DOCKER_HOST": docker_host}
        self.argv = agent_argv(name, store, sample_seconds=0.5, heartbeat_seconds=1)
        self.restarts, self.restart_policy = 0, restart  # compose's services: restart: unless-stopped
        self.container = self._create()

    def _create(self):
        return self.client.containers.create("vllm-panel-node:test", self.argv, name=f"nodeagent-{self.name}",
                                             environment=self.env, working_dir=str(ROOT), network_mode="host",
                                             pid_mode="host", ipc_mode="host",
                                             restart_policy={"Name": self.restart_policy})

    def pid(self) -> int:
        self.container.reload()
        return self.container.attrs["State"]["Pid"]

    def registered(self) -> Node:
        pid = self.pid()
        return wait_until(lambda: Node.objects.filter(name=self.name, agent_pid=pid).first(), timeout=90,
                          message=f"agent {self.name} (container PID {pid}) to register")

    def start(self) -> Node:
        self.container.start()
        return self.registered()

    def restart(self) -> Node:
        """`docker restart`, and every other time what `docker compose up -d` does after a new build: stop and
        remove the agent's container, create a new one and start it."""
        self.restarts += 1
        if self.restarts % 2:
            self.container.restart(timeout=STOP_GRACE_S)
        else:
            self.container.stop(timeout=STOP_GRACE_S)
            self.container.remove()
            self.container = self._create()
            self.container.start()
        COUNTS["agent_container_restarts"] += 1
        return self.registered()


@pytest.fixture
def docker_daemon(tmp_path, monkeypatch):
    with dockerd.running(tmp_path / "dockerd", handle=True) as daemon:
        monkeypatch.setenv("DOCKER_HOST", daemon.host)  # this test's own containers.find(), as the agent's reads it
        yield daemon


@pytest.fixture
def docker_host(docker_daemon):
    return docker_daemon.host


def _adopted(d) -> int:
    return DeploymentEvent.objects.filter(deployment_id=d.pk, step="adopted").count()


def _serving(node, fake_model):
    model = add_fake_model(node, fake_model)
    d = deploy(model, node)
    row = settle(d, timeout=60)
    assert row.status == "ready", row.status_message
    return row


def _restarts_keep_serving(restart, row, fake_model, engine_containers=None):
    """Restart the agent RESTARTS times under a request stream; each time the engine answers throughout and
    the new agent adopts it (same PID, still ready, one engine)."""
    key = engineapikey.of(row)
    served = httpx.get(f"http://127.0.0.1:{row.port}/v1/models", headers=vllm.auth_headers(key),
                       timeout=5).json()["data"][0]["id"]
    with RequestStream(row.port, served, key) as stream:
        wait_until(lambda: len(stream.done) >= 5, timeout=20, message="the stream to get going")
        for i in range(RESTARTS):
            down = time.monotonic()
            restart()
            wait_until(lambda: _adopted(row) >= i + 1, timeout=60, message=f"restart {i + 1}: the engine adopted")
            up = time.monotonic()
            now = Deployment.objects.get(pk=row.pk)
            assert (now.status, now.pid) == ("ready", row.pid), f"restart {i + 1}: {now.status} {now.pid} {now.status_message}"
            assert stream.answered_between(down, up) > 0, "no request was answered while the agent was away"
            if engine_containers is not None:
                assert [(c["pid"], c["status"]) for c in engine_containers(row.marker)] == [(row.pid, "running")]
            assert_true_state(row, fake_model)
        time.sleep(0.5)
    assert stream.failed == [], f"{len(stream.failed)} of {len(stream.done) + len(stream.failed)} requests failed"
    COUNTS["requests_across_agent_restarts"] += len(stream.done)
    print(f"{RESTARTS} agent restarts, {len(stream.done)} requests answered, {len(stream.failed)} lost")


@pytest.mark.timeout(120 + 40 * RESTARTS)
def test_restarting_the_agent_container_keeps_its_engine_container_serving(docker_host, process_env, unique, tmp_path,
                                                                          fake_model):
    set_load(fake_model, 0.3)
    env = agent_env(process_env, tmp_path, **{containers.RUNTIME_VAR: "docker", containers.IMAGE_VAR: "vllm-panel-node:test",
                                             containers.MOUNTS_VAR: f"{tmp_path}:{tmp_path}"})
    agent = AgentContainer(docker_host, env, f"keep-{unique}", tmp_path / "store")
    row = _serving(agent.start(), fake_model)
    [engine_container] = containers.find(row.marker)
    assert engine_container["pid"] == row.pid, "the deployment's engine is the engine container's main process"
    _restarts_keep_serving(agent.restart, row, fake_model, containers.find)
    stop_and_check(row, fake_model)
    wait_until(lambda: containers.find(row.marker) == [], timeout=10, message="the stopped engine's container to go")


@pytest.mark.timeout(300)
def test_a_persisted_engine_container_comes_back_after_a_crash_and_a_reboot_and_is_adopted(docker_daemon, process_env,
                                                                                          unique, tmp_path, fake_model):
    """Compose has no systemd for the agent: Persist keeps the engine's own container with Docker's restart policy,
    with no second load. Docker starts it again after a crash and at a boot (the agent's container too, as compose's
    `restart: unless-stopped` does), and the agent adopts it by its marker, ready again; a stop releases it, and the
    next boot brings nothing back."""
    set_load(fake_model, 0.3)
    env = agent_env(process_env, tmp_path, **{containers.RUNTIME_VAR: "docker", containers.IMAGE_VAR: "vllm-panel-node:test",
                                             containers.MOUNTS_VAR: f"{tmp_path}:{tmp_path}"})
    agent = AgentContainer(docker_daemon.host, env, f"kept-{unique}", tmp_path / "store", restart="unless-stopped")
    node = agent.start()
    wait_until(lambda: Node.objects.get(pk=node.pk).systemd, timeout=30, message="the node to say it can keep engines")
    row = _serving(node, fake_model)
    loads = DeploymentEvent.objects.filter(deployment_id=row.pk, step="load").count()
    deploys.deployment_persist(row)
    kept = wait_until(lambda: (r := Deployment.objects.get(pk=row.pk)).systemd_unit and r, timeout=30,
                      message="the engine's container kept")
    [engine] = containers.find(row.marker)
    assert kept.systemd_unit == keepers.of_container(engine["name"]) and (kept.status, kept.pid) == ("ready", row.pid)
    assert containers.state(engine["name"])["policy"] == containers.KEEP_POLICY
    assert DeploymentEvent.objects.filter(deployment_id=row.pk, step="load").count() == loads, "no second load"

    def back_ready(after: int, why: str):
        """Ready again with the kept container's new engine adopted (the adoptions after `after`)."""
        wait_until(lambda: _adopted(row) > after, timeout=90, message=f"{why}: the engine adopted")
        now = wait_until(lambda: (r := Deployment.objects.get(pk=row.pk)).status in ("ready", "failed") and r,
                         timeout=60, message=f"{why}: ready again")
        [found] = containers.find(row.marker)
        assert (now.status, now.pid) == ("ready", found["pid"]), (why, now.status, now.status_message, found)
        assert found["name"] == engine["name"] and now.systemd_unit == kept.systemd_unit
        assert_true_state(now, fake_model)
        return now

    os.kill(row.pid, signal.SIGKILL)  # a crash: Docker starts it again, not the panel
    crashed = back_ready(_adopted(row), "crash")
    assert crashed.pid != row.pid and crashed.restarts == 0
    docker_daemon.reboot()  # the host's power cycle: every container killed, then the daemon starts the kept ones
    agent.registered()
    rebooted = back_ready(_adopted(row), "reboot")
    assert rebooted.pid != crashed.pid
    # A redeploy of a persisted deployment: the old container released, the new engine's own container kept in turn.
    deploys.deployment_redeploy(rebooted)
    redeployed = settle(rebooted, timeout=60)
    [new] = containers.find(redeployed.marker)
    assert redeployed.status == "ready" and new["pid"] == redeployed.pid and new["name"] != engine["name"]
    assert redeployed.systemd_unit == keepers.of_container(new["name"])
    assert containers.state(new["name"])["policy"] == containers.KEEP_POLICY and containers.state(engine["name"]) is None
    stop_and_check(redeployed, fake_model)
    assert containers.find(redeployed.marker) == [], "a stopped deployment's container is released"
    docker_daemon.reboot()
    agent.registered()
    assert containers.find(redeployed.marker) == [] and Deployment.objects.get(pk=row.pk).status == "stopped"


@pytest.mark.timeout(120)
def test_engines_that_are_the_agent_containers_own_processes_die_with_it(docker_host, process_env, unique, tmp_path,
                                                                        fake_model):
    """The old compose path, for contrast: the engine lives in the agent container's cgroup and a restart of the
    agent container takes it down; the new agent finds it gone and fails the deployment."""
    set_load(fake_model, 0.3)
    env = agent_env(process_env, tmp_path, **{containers.RUNTIME_VAR: "process"})
    agent = AgentContainer(docker_host, env, f"gone-{unique}", tmp_path / "store")
    row = _serving(agent.start(), fake_model)
    agent.restart()
    assert not processes.alive(row.pid), "the engine survived its agent container's restart"
    assert settle(row, timeout=30, states={"failed"}).status == "failed"
    assert_true_state(row, fake_model)


@pytest.fixture
def panel(process_env, private_redis, spawn, unique, tmp_path):
    """`./panel start` (python -m panelctl.launcher start) on this test's database and private Redis;
    yields a function that (re)starts it and returns its node; stopped with Ctrl-C's SIGINT at the end."""
    env = agent_env(process_env, tmp_path, REDIS_URL=private_redis.url, PANEL_ADMIN_PASSWORD="correct-horse-battery-9")
    ports = {"web": free_port(), "gateway": free_port()}
    argv = [sys.executable, "-m", "panelctl.launcher", "start", "--port", str(ports["web"]),
            "--gateway-port", str(ports["gateway"]), "--node-name", f"up-{unique}"]
    running, agents = [], set()

    def start() -> Node:
        running.append(spawn(argv, env, name="panel"))
        node = wait_until(lambda: Node.objects.filter(name=f"up-{unique}").exclude(agent_pid=None)
                          .exclude(agent_pid__in=agents).first(), timeout=120, message="./panel start's agent to register")
        agents.add(node.agent_pid)
        return node

    def stop():
        proc = running.pop()
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops its web, worker and agent, and exits
        proc.wait(60)

    start.ports, start.running = ports, running
    yield start, stop
    while running:
        stop()


@pytest.mark.timeout(180 + 90 * RESTARTS)
def test_restarting_panel_start_keeps_its_engine_serving(panel, fake_model):
    start, stop = panel
    set_load(fake_model, 0.3)
    row = _serving(start(), fake_model)

    def restart():
        stop()
        assert processes.alive(row.pid), "the engine stopped with ./panel start"
        start()
        COUNTS["panel_start_restarts"] += 1

    _restarts_keep_serving(restart, row, fake_model)
    stop_and_check(row, fake_model)


@pytest.mark.timeout(240)
def test_a_killed_agent_is_started_again_by_the_launcher_while_the_web_and_the_gateway_stay_up(panel, fake_model):
    """kill -9 of ./panel start's node agent once stopped the whole panel, the gateway (callers' one door) included,
    with the engine left running and unreachable. Now the launcher starts the agent again with backoff; the web and
    the gateway answer throughout, the engine keeps serving, and the new agent adopts it."""
    start, stop = panel
    node = start()
    row = _serving(node, fake_model)
    launcher = start.running[-1]
    ports = start.ports
    answers = {"web": [], "gateway": []}
    os.kill(node.agent_pid, signal.SIGKILL)
    killed = time.monotonic()
    while _adopted(row) < 1 and time.monotonic() - killed < 90:
        for name, port in ports.items():
            try:
                answers[name].append(httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code)
            except httpx.HTTPError as exc:
                answers[name].append(repr(exc))
        assert launcher.poll() is None, "./panel start exited when its agent was killed"
        time.sleep(0.2)
    back = Node.objects.get(pk=node.pk)
    assert _adopted(row) == 1 and back.agent_pid != node.agent_pid, "the agent did not come back and adopt the engine"
    assert set(answers["web"]) == {200} and set(answers["gateway"]) == {200}, answers
    now = Deployment.objects.get(pk=row.pk)
    assert (now.status, now.pid) == ("ready", row.pid), now.status_message
    assert_true_state(row, fake_model)
    lost = DeploymentEvent.objects.get(deployment_id=row.pk, step="agent").message
    assert lost.startswith(f"The node agent (PID {node.agent_pid}) was lost after its last heartbeat at "), lost
    log = open(launcher.log_path).read()
    assert "nodeagent exited with code -9; starting it again in 1 s (the rest of the panel keeps running)." in log, log[-3000:]
    print(f"agent back and the engine adopted {time.monotonic() - killed:.1f} s after kill -9; "
          f"{len(answers['web'])} web and gateway health checks meanwhile, all 200")
    stop_and_check(row, fake_model)
