"""Shared fixtures. Django is imported lazily so `tests/gpu` runs on a GPU host without Django."""
import contextlib
import fcntl
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ENGINE_VENV = Path(os.environ.get("ENGINE_VENV", ROOT / ".engine-venv"))
VLLM = ENGINE_VENV / "bin" / "vllm"
# Playwright's sync API keeps an event loop running in the test thread; the ORM calls made next
# to it are still plain synchronous calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


# Real-GPU checks run only on a GPU host, invoked explicitly (see tests/gpu/conftest.py).
collect_ignore = ["gpu"]


# Folders and markers agree: a test in one of these folders carries its marker (added here), and a test
# carrying one of these markers lives in its folder, so `-m` and a path select the same tests.
FOLDER_MARKERS = {"e2e": "e2e", "faults": "faults", "integration": "integration"}
# Folders of one set of checks run against real parts and their doubles: the real parts' cases carry their marker.
MIXED_FOLDERS = {"conformance": {"e2e"}}
SLOW_S = 60.0  # a test past this carries @pytest.mark.slow and a docstring saying why


def pytest_collection_modifyitems(config, items):
    misplaced = []
    for item in items:
        parts = Path(str(item.path)).relative_to(ROOT / "tests").parts
        folder = parts[0] if len(parts) > 1 else ""
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
        for folder_name, marker in FOLDER_MARKERS.items():
            if marker != FOLDER_MARKERS.get(folder) and item.get_closest_marker(marker) \
                    and marker not in MIXED_FOLDERS.get(folder, ()):
                misplaced.append(f"{item.nodeid} is marked {marker} but is not in tests/{folder_name}/")
        if folder not in FOLDER_MARKERS and "tiny_model" in getattr(item, "fixturenames", ()):
            misplaced.append(f"{item.nodeid} is in the fast tier, which installs no engine to build the tiny model "
                             "with: take tiny_model_files (tokenizer and config) or move it to its tier's folder")
        if item.get_closest_marker("slow") and not (getattr(item.obj, "__doc__", None) or "").strip():
            misplaced.append(f"{item.nodeid} is marked slow without a docstring saying why it must be")
    if misplaced:
        raise pytest.UsageError("\n".join(misplaced))
    other_db = "sqlite_only" if os.environ.get("DATABASE_URL", "").startswith("postgres") else "postgres_only"
    one_db = [item for item in items if item.get_closest_marker(other_db)]
    if one_db:
        config.hook.pytest_deselected(items=one_db)
        items[:] = [item for item in items if not item.get_closest_marker(other_db)]
    items[:] = _lanes(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def _lanes(items: list, workers: int) -> list:
    """The order for xdist's work stealing, which hands worker i the i-th contiguous 1/workers of the tests and lets
    an idle worker take half of another's queue from its end. The long tests (slow, end-to-end, faults,
    integration) go to the workers in whole modules, the modules of one `exclusive` name together (two workers
    would otherwise reach them at the same time and one would wait idle for the other), each group to the worker
    with the least long work so far (heaviest first); then each worker's share is filled up with short tests to
    an equal count. The short ones are what gets stolen, the long ones never wait at the end. A test that must run
    `alone` (no other engine meanwhile) goes first on the first worker, while the others start on tests without an
    engine, so nobody waits for it."""
    ordered = sorted(items, key=_cost_rank)
    if workers < 2:
        return ordered
    long = [item for item in ordered if _cost_rank(item) < 4]
    short = ordered[len(long):]
    groups: dict[str, list] = {}
    for item in long:
        exclusive = item.get_closest_marker("exclusive")
        groups.setdefault(f"exclusive:{exclusive.args[0]}" if exclusive else str(item.path), []).append(item)
    lanes: list[list[list]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    alone = lambda group: any(item.get_closest_marker("alone") for item in group)  # noqa: E731
    for group in sorted(groups.values(), key=lambda group: (alone(group), _weight(group)), reverse=True):
        lane = 0 if alone(group) else loads.index(min(loads))
        lanes[lane].append(group)
        loads[lane] += _weight(group)
    for lane in lanes[1:]:  # stable: heaviest first among those without an engine, then those with one
        lane.sort(key=lambda group: any("tiny_model" in getattr(item, "fixturenames", ()) for item in group))
    flat = [[item for group in lane for item in group] for lane in lanes]
    size = -(-len(items) // workers)
    for lane in flat:
        take = max(0, size - len(lane))
        lane += short[:take]
        short = short[take:]
    flat[-1] += short
    return [item for lane in flat for item in lane]


# Rough seconds of a test by its marker (CI's --durations: a slow test 80-440 s, another end-to-end 15-60 s, a
# fault test 10-40 s, an integration one 2-15 s): enough to share out whole modules evenly.
_MARKER_SECONDS = (("slow", 150.0), ("e2e", 30.0), ("faults", 20.0), ("integration", 5.0))


def _weight(tests: list) -> float:
    """Seconds by marker for each test function, a second for each further case of a parametrized one (the API
    fuzz's 70 cases are one function's, not 70 slow tests)."""
    functions = {}
    for item in tests:
        key = (str(item.path), getattr(item, "originalname", item.name))
        functions[key] = next((s for m, s in _MARKER_SECONDS if item.get_closest_marker(m)), 1.0)
    return sum(functions.values()) + len(tests) - len(functions)


def _cost_rank(item) -> int:
    """Slow, then end-to-end, fault and integration tests, then the rest (a stable sort keeps modules together)."""
    for rank, (marker, _) in enumerate(_MARKER_SECONDS):
        if item.get_closest_marker(marker):
            return rank
    return 4


_durations: dict[str, float] = {}
_slow_ids: set[str] = set()
_lock_waits: dict[str, float] = {}  # test -> seconds its worker waited for another's test (exclusive, alone)


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if "slow" in report.keywords:  # the report's own markers (under xdist the controller collects nothing)
        _slow_ids.add(report.nodeid)


def pytest_sessionfinish(session):
    """An xdist worker hands the faults it injected (tests/truestate.COUNTS) to the controller, which prints them.
    The controller, once every worker ended, takes out of the loopback door's set (host/door.py) the ports whose
    shutting process is gone and nothing listens on: plans run against fake engines that no test stops would
    otherwise leave ports such as 8000 closed to every other user of the machine. Never the ports of a run beside
    this one while its workers and agents live."""
    if hasattr(session.config, "workeroutput"):
        from tests.truestate import COUNTS

        session.config.workeroutput["fault_counts"] = dict(COUNTS)
        session.config.workeroutput["lock_waits"] = dict(_lock_waits)
    elif not hasattr(session.config, "workerinput"):
        from deployments.host import door

        import psutil

        listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        door._drop({port for port, (_, pid) in door.door_elements().items()
                    if not psutil.pid_exists(pid) and port not in listening})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from tests.truestate import COUNTS

    COUNTS.update(getattr(node, "workeroutput", {}).get("fault_counts", {}))
    _lock_waits.update(getattr(node, "workeroutput", {}).get("lock_waits", {}))


def pytest_terminal_summary(terminalreporter, config):
    """The faults injected, then every test past SLOW_S (setup and teardown included) that is not marked slow."""
    from tests.truestate import COUNTS

    if COUNTS:
        terminalreporter.write_line("faults: " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())))
    if _lock_waits:
        terminalreporter.section(f"workers idle behind another's test: {sum(_lock_waits.values()):.0f} s in all")
        for nodeid, seconds in sorted(_lock_waits.items(), key=lambda kv: -kv[1])[:10]:
            terminalreporter.write_line(f"{seconds:7.1f} s  before {nodeid}")
    unmarked = [(s, nodeid) for nodeid, s in _durations.items() if s > SLOW_S and nodeid not in _slow_ids]
    if unmarked:
        terminalreporter.section(f"tests over {SLOW_S:.0f} s not marked slow")
        for seconds, nodeid in sorted(unmarked, reverse=True):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On CI every part is installed, so a skipped test is a missing install step: fail it."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, where nothing may be skipped: {report.longrepr}"


FREE_PORTS = (20000, 32767)  # above Ray's worker ports (10002-19999), below the kernel's ephemeral range


def free_port() -> int:
    """A port nothing holds, for a server that binds it later (an engine, after a load of a minute). Not one the
    kernel picks (bind to 0): those come from its ephemeral range, which every connect() and bind(0) of any
    process draws from meanwhile (a run beside this one took a Ray engine's port that way). Random, so two
    sessions seldom pick the same one."""
    low, high = FREE_PORTS
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        high = min(high, int(f.read().split()[0]) - 1)
    pick = random.SystemRandom()
    for _ in range(1000):
        port = pick.randint(low, high)
        try:
            with socket.socket() as anywhere:  # free on every address, loopback included
                anywhere.bind(("0.0.0.0", port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port in {low}-{high}")


def wait_until(predicate, timeout=15.0, interval=0.05, message="condition"):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {message}")


# Fixtures through which a test reaches the database, and so the rows that live state is keyed by.
_DB_FIXTURES = {"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"}


@pytest.fixture(autouse=True, scope="session")
def _checkout_enterable_by_engines():
    """Engines run as their own user: they must enter the checkout's folders to reach var/tiny-model and the
    fake engine in tests/faults. A clone under a folder closed to others (/root is 0700) gets o+x, and only
    that, on each folder above it that lacks it."""
    if os.geteuid() != 0:
        return
    for folder in (ROOT, *ROOT.parents):
        mode = folder.stat().st_mode
        if not mode & 0o001:
            folder.chmod(mode | 0o001)


@pytest.fixture(autouse=True)
def _tmp_enterable_by_engines(request):
    """Engines run as their own user (vllm-engine) and pytest makes its folders 0700: enter-only (0711) for
    the folders from /tmp down to this test's tmp_path, so an engine reaches the model folders, fake engines
    and stand-ins a test puts there (it still cannot list them; files keep their modes)."""
    if os.geteuid() != 0 or "tmp_path" not in request.fixturenames:
        return
    path = request.getfixturevalue("tmp_path")
    top = Path(tempfile.gettempdir())
    for p in (path, *path.parents):
        if p == top or p == p.parent:
            break
        p.chmod(p.stat().st_mode | 0o011)


@pytest.fixture(autouse=True)
def _fresh_live_state(request):
    """Snapshots and history are keyed by row id, and ids repeat between tests: start empty.
    The same for cached API answers: a test's rolled-back rows leave no write behind to mark them stale.
    A test without the database (pure host and runner code) has no rows and needs no Redis."""
    if not (_DB_FIXTURES & set(request.fixturenames) or request.node.get_closest_marker("django_db")):
        return
    from plumbing import apicache, fastlane
    from plumbing import redisconn

    apicache.clear()
    fastlane.learned.clear()

    client = redisconn.client()
    prefix = os.environ["CHANNELS_PREFIX"]
    for pattern in (f"{prefix}:snapshot:*", f"{prefix}:history:*", f"{prefix}:fleet:*"):
        keys = list(client.scan_iter(pattern, count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(autouse=True)
def _alone_or_beside(request):
    """Under pytest-xdist the suite runs on two workers at once. A test marked `alone` counts every real engine's
    /dev/shm file that appears while it runs as its own, so no other real engine may start meanwhile: it holds
    this run's engine lock exclusively, and every test that serves the tiny model holds it shared."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    alone = request.node.get_closest_marker("alone") is not None
    exclusive = request.node.get_closest_marker("exclusive")
    started = time.monotonic()
    with contextlib.ExitStack() as held:
        if run and exclusive:  # one test at a time of those naming this (e.g. clusters over one host's two addresses)
            fcntl.flock(held.enter_context(_lock_file(run, exclusive.args[0])), fcntl.LOCK_EX)
        if run and (alone or "tiny_model" in request.fixturenames):
            fcntl.flock(held.enter_context(_lock_file(run, "engines")), fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        waited = time.monotonic() - started
        if waited >= 1:  # a worker idle behind the other's test: CI prints these (pytest_terminal_summary)
            _lock_waits[request.node.nodeid] = waited
        yield


def _lock_file(run: str, name: str):
    return open(Path(tempfile.gettempdir()) / f"panel-tests-{run}.{name}.lock", "a")


@pytest.fixture
def timed(settings):
    """Each answer says where it was served (its Server-Timing header: a cache hit or miss, or the fast lane)."""
    settings.SERVER_TIMING = True


@pytest.fixture
def operator(db):
    from tests.factories import UserFactory

    return UserFactory(role="operator")


@pytest.fixture
def viewer(db):
    from tests.factories import UserFactory

    return UserFactory(role="viewer")


@pytest.fixture
def api_objects(db, sent_tasks):
    """One of each thing the API serves (a node with a GPU, a model copy, a deployment, a run), with
    task sends caught before the broker."""
    from tests.factories import (BenchmarkRunFactory, DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory,
                                 StudyFactory)

    node = NodeFactory(name="n1")
    GpuFactory(node=node, index=0)
    copy = ModelCopyFactory(node=node)
    d = DeploymentFactory(node=node, model=copy.model, status="ready")
    run = BenchmarkRunFactory(deployment=d)
    study = StudyFactory(deployment=d)
    return {"nodes": node, "models": copy.model, "copies": copy, "deployments": d, "runs": run, "studies": study}


@pytest.fixture
def sent_tasks():
    """The tasks the code sends, recorded instead of reaching the broker (tests/taskqueue.py)."""
    from tests.taskqueue import recording

    with recording() as sent:
        yield sent


@pytest.fixture
def api(operator):
    """A DRF test client signed in as an operator (a module may override it, e.g. with a real token)."""
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(operator)
    return client


@pytest.fixture
def operator_client(client, operator):
    client.force_login(operator)
    return client


@pytest.fixture
def viewer_client(client, viewer):
    client.force_login(viewer)
    return client


@pytest.fixture
def unique():
    """A short unique suffix, so tests sharing one Redis never see each other's queues or groups."""
    return uuid.uuid4().hex[:8]


@pytest.fixture
def process_env(transactional_db, tmp_path_factory):
    """Environment for child processes (agents, workers) that must see the test database; their agents read local
    models from the tests' own folders."""
    from django.conf import settings
    from django.db import connection

    env = dict(os.environ)
    env["LOCAL_MODEL_ROOTS"] = str(tmp_path_factory.getbasetemp())
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        env["DATABASE_URL"] = f"sqlite:///{db['NAME']}"
    else:
        env["DATABASE_URL"] = f"postgres://{db['USER']}:{db['PASSWORD']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env["REDIS_URL"] = settings.REDIS_URL
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def spawn(tmp_path):
    """Start child processes in their own session; every one is killed at the end of the test."""
    procs = []

    def start(argv, env, name="proc"):
        log = open(tmp_path / f"{name}-{len(procs)}.log", "wb")
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = log.name
        procs.append(proc)
        return proc

    yield start
    # SIGKILL at once: a Celery worker's warm shutdown on SIGTERM waited out its 5 s for every agent of
    # every test. Nothing is lost: each test has its own queues, and engines live in their own sessions
    # (the fixtures that start them stop them).
    for proc in procs:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(10)


def agent_argv(name, model_store, sample_seconds=0.5, heartbeat_seconds=0.5):
    return [sys.executable, "manage.py", "nodeagent", "--name", name, "--model-store", str(model_store),
            "--sample-seconds", str(sample_seconds), "--heartbeat-seconds", str(heartbeat_seconds)]


@pytest.fixture
def live_server_asgi(transactional_db):
    """The real ASGI app (HTTP + WebSockets) served by uvicorn in a thread, on a free port."""
    import uvicorn

    from controlpanel.asgi import application

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, log_level="warning",
                                           ws="websockets-sansio", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, message="the ASGI server to start")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    # A WebSocket still open at the end leaves its receive() counted on the process's channel layer, tied
    # to the server's dead loop: the next test's loop would get "Two event loops are trying to receive()".
    from channels.layers import channel_layers

    channel_layers.backends.clear()


@pytest.fixture(scope="session")
def browser_type_launch_args():
    """Debian's Chromium; Playwright's own browser download cannot work offline."""
    return {
        "executable_path": CHROMIUM,
        "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"],
    }


@pytest.fixture
def logged_in_page(page, live_server_asgi, operator):
    """A Chromium page logged in as an operator through the real login form."""
    page.goto(f"{live_server_asgi}/accounts/login/")
    page.fill("#id_username", operator.username)
    page.fill("#id_password", "pw-for-tests-1")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server_asgi}/")
    page.base_url = live_server_asgi
    return page


def in_thread(fn, *args, **kwargs):
    """Run `fn` in another thread: async_to_sync refuses the test thread while Playwright's loop runs."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result(45)


def run_async(coro, timeout: float = 30):
    """Run a coroutine to the end (at most `timeout` s) on its own loop in another thread (Playwright may own this
    one), on a channel layer of its own; what it left running is cancelled, and a task that will not end within
    10 s fails the test naming where it waits, instead of hanging it (asyncio.run waits for ever: CI lost a test to
    a WebSocket consumer that did not end)."""
    import asyncio

    from channels.layers import channel_layers

    def run():
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(asyncio.wait_for(coro, timeout))
        finally:
            # Cancelled again until they end: a channel layer's receive in a blocking Redis read can swallow one
            # cancellation and read again (channels_redis with redis-py), so asyncio.run's one cancel waits for ever.
            stuck, deadline = {task for task in asyncio.all_tasks(loop) if not task.done()}, time.monotonic() + 10
            while stuck and time.monotonic() < deadline:
                for task in stuck:
                    task.cancel()
                stuck = loop.run_until_complete(asyncio.wait(stuck, timeout=0.2))[1]
            if not stuck:
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            assert not stuck, f"tasks that did not end once cancelled: {[task.get_stack() for task in stuck]}"

    channel_layers.backends.clear()  # a layer's receive state belongs to one loop: the last test's is not shared
    return in_thread(run)


@pytest.fixture(scope="session")
def tiny_model_files(tmp_path_factory) -> Path:
    """The tiny model's tokenizer and config, without weights, built with the panel's own packages: the fast tier's
    tests of tokenizer files and model copies need no engine venv (a fresh clone's `./panel test --fast` has none)."""
    from tests import tinymodel

    return tinymodel.model_files(tmp_path_factory.mktemp("tiny-model-files"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random Llama the CPU engine serves (scripts/install-engine builds var/tiny-model)."""
    built = ROOT / "var" / "tiny-model"
    if (built / "config.json").exists():
        return built
    if not (ENGINE_VENV / "bin" / "python").exists():  # `./panel test --fast` installs no engine
        pytest.skip("the tiny model is built with the engine's venv: scripts/install-engine (./panel test runs it)")
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([str(ENGINE_VENV / "bin" / "python"), str(ROOT / "tests" / "tinymodel.py"), str(out)],
                   check=True, timeout=300)
    for path in (out, *out.iterdir()):  # engines run as their own user; safetensors writes its file 0600
        path.chmod(path.stat().st_mode | 0o044 | (0o011 if path.is_dir() else 0))
    return out
