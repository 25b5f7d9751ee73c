"""A Stop always happens, with real agents and the fake engine: the halt dropped three
ways (the web process killed after its commit, before on_commit sent it; Redis emptied by FLUSHALL right
after the Stop; every worker thread of the agent held by throttled downloads) and the engine is stopped
every time, by the re-drive where the halt was lost (the agent's log says it re-drove it, once for each loss);
a Stop pressed again sends the halt again, and the queue's halt stops the engine, not the re-drive; a worker
rank's lost halt is re-driven by its own node's agent; a benchmark run whose run_execute was lost runs all the
same.

A halt that nothing picked up runs by REDRIVE_AFTER_S + REDRIVE_EVERY_S after the Stop (deployments/node/redrive.py),
plus the halt itself; one the queue still delivers runs at once on the agent's control lane, and a plan on its plans
lane, even while every host thread downloads (plumbing/pool.py). Which of the two stopped an engine is read from the
agent's log, never from a clock: the seconds each took are the tests' figures (tests/faults/conftest.py's `figure`),
which perf/fault_soak.py prints over a soak."""
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import redis
from django.db import connection

from benchmarks.models import BenchmarkRun
from deployments.models import Deployment, DeploymentRank, ModelCopy, ModelRepo, Node
from deployments.node.redrive import REDRIVE_AFTER_S, REDRIVE_EVERY_S
from deployments.services import deploys, repos
from tests.conftest import ROOT, free_port, in_thread, wait_until
from tests.faults.conftest import KILLS
from tests.hfserver import configure, serve
from tests.truestate import (COUNTS, FAKE_VLLM, Agent, add_fake_model, agent_env, assert_true_state, deploy,
                             engines_under, settle, stop_leftover_engines)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
HALT_S = 10.0  # the fake engine's halt, a few database writes, and a shared 2-core machine's load (load average 10 seen)
LOST_BOUND_S = REDRIVE_AFTER_S + REDRIVE_EVERY_S + HALT_S  # a halt no message will ever bring (sizes the timeouts)
GUARD_S = 120.0  # a stop not done by then is hung: a guard against a hang, not a bound the test checks
MB = 1 << 20


def _stopped(d, folder, since: float) -> float:
    """Wait until the deployment is Stopped and its engine gone, and check the true state; the seconds since `since`
    (a figure for the report, compared with nothing here)."""
    settle(d, timeout=GUARD_S, states={"stopped"})
    wait_until(lambda: not engines_under(folder), timeout=GUARD_S, message="the engine to be gone")
    took = time.monotonic() - since
    assert_true_state(d, folder)
    return took


def _ready(model, node, d=None):
    d = deploy(model, node) if d is None else deploys.deployment_redeploy(Deployment.objects.get(pk=d.pk))
    assert settle(d, timeout=60).status == "ready"
    return d


def _killed_web(process_env, what: str, pk: int) -> None:
    """The request in a web process SIGKILLed after its commit, before on_commit (tests/faults/killed_web.py)."""
    done = subprocess.run([sys.executable, "tests/faults/killed_web.py", what, str(pk)], cwd=ROOT, env=process_env,
                          capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    COUNTS["web_killed_after_commit"] += 1


PLAN_ENDED = re.compile(r"Task deployments\.deployment_run\[[^\]]+\] (?:succeeded|raised)")


def _log(agent) -> str:
    return open(agent.proc.log_path, encoding="utf-8", errors="replace").read()


def _redriven(agent, name: str) -> int:
    """How many times the agent's log says it re-drove task `name`: proof the halt really was lost."""
    return _log(agent).count(f"re-driving {name}(")


@contextmanager
def _frozen(agent):
    """The agent stopped (SIGSTOP) at a moment it holds no database transaction: a frozen SQLite writer
    would lock the test out, a frozen PostgreSQL transaction might hold the row the Stop locks."""
    for _ in range(50):
        os.killpg(agent.proc.pid, signal.SIGSTOP)
        wait_until(lambda: _all_threads_stopped(agent.proc.pid), timeout=5, message="the agent's threads to stop")
        if not _transaction_open():
            break
        os.killpg(agent.proc.pid, signal.SIGCONT)
        time.sleep(0.1)
    else:
        pytest.fail("the agent was inside a transaction at every try")
    try:
        yield
    finally:
        os.killpg(agent.proc.pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    """SIGSTOP is delivered to each thread in its own time: a thread still running may yet take a lock."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt" for t in tasks.iterdir())


def _transaction_open() -> bool:
    """Whether another process holds a transaction on the test database, or (SQLite) any lock on it: a reader
    frozen inside a SELECT holds a shared lock, which lets a write begin but not commit ("database is locked")."""
    if connection.vendor == "sqlite":
        probe = sqlite3.connect(connection.settings_dict["NAME"], timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN EXCLUSIVE")
            probe.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError:
            return True
        finally:
            probe.close()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND pid <> pg_backend_pid() AND xact_start IS NOT NULL")
        return cursor.fetchone()[0] > 0


@pytest.mark.timeout(150 + KILLS * 3 * LOST_BOUND_S)
def test_a_stop_and_a_run_lost_with_the_web_process_are_redriven(fault_agent, fake_model, process_env, figure):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    d = None
    for attempt in range(KILLS):
        d = _ready(model, node, d)
        _killed_web(process_env, "stop", d.pk)
        asked = time.monotonic()  # (the Stop committed a moment ago, as the web process died)
        assert Deployment.objects.get(pk=d.pk).status == "stopping"  # committed, and no halt was ever sent
        figure("lost_halt_s", _stopped(d, fake_model, asked))
        COUNTS["lost_halts_survived"] += 1
    assert _redriven(fault_agent, "deployments.deployment_halt") == KILLS
    assert d.events.filter(step="stop", level="warning", message__startswith="The halt was lost").count() == KILLS

    # Pressing Stop again sends the halt again: nothing waits for the re-drive.
    d = _ready(model, node, d)
    _killed_web(process_env, "stop", d.pk)
    asked = time.monotonic()
    deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
    figure("halt_sent_again_s", _stopped(d, fake_model, asked))
    assert _redriven(fault_agent, "deployments.deployment_halt") == KILLS  # the halt sent again stopped it

    # A run whose run_execute was never sent no longer sits Queued for ever, blocking every new run.
    d = _ready(model, node, d)
    _killed_web(process_env, "bench", d.pk)
    asked = time.monotonic()
    run = BenchmarkRun.objects.get(deployment=d)
    assert run.status == "queued"
    wait_until(lambda: BenchmarkRun.objects.get(pk=run.pk).status != "queued", timeout=GUARD_S,
               message="the lost run to be re-driven")
    figure("lost_run_s", time.monotonic() - asked)
    assert _redriven(fault_agent, "benchmarks.run_execute") == 1
    COUNTS["lost_runs_survived"] += 1
    ended = wait_until(lambda: (r := BenchmarkRun.objects.get(pk=run.pk)).status in BenchmarkRun.TERMINAL and r,
                       timeout=60, message="the re-driven run to end")
    assert ended.status == "done", ended.error
    assert ended.points.exists()  # it measured: one copy of the task ran it, not none
    asked = time.monotonic()
    deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
    figure("halt_sent_s", _stopped(d, fake_model, asked))
    assert _redriven(fault_agent, "deployments.deployment_halt") == KILLS  # the queue's halt stopped it


@pytest.mark.timeout(120 + KILLS * 2 * LOST_BOUND_S)
def test_a_halt_flushed_from_redis_right_after_the_stop_is_redriven(private_redis, process_env, spawn, unique,
                                                                      tmp_path, fake_model, figure):
    env = agent_env(process_env, tmp_path, REDIS_URL=private_redis.url)
    agent = Agent(spawn, env, f"flush-{unique}", tmp_path / "store")
    node = agent.start()
    model = add_fake_model(node, fake_model)
    client = redis.Redis(port=private_redis.port)
    d = None
    try:
        for attempt in range(KILLS):
            d = _ready(model, node, d)
            # The plan ends a moment after the row reads ready; one still running when the Stop comes halts the
            # engine it launched itself (test_stop_wins), and the halt would not be lost. Frozen after it ended.
            wait_until(lambda: len(PLAN_ENDED.findall(_log(agent))) >= attempt + 1, timeout=GUARD_S,
                       message="the deploy plan to end")
            # The agent frozen for the moment of the Stop: once its consumers' BRPOPs (1 s) have returned (Redis
            # counts no blocked client: a frozen agent sends no new one), the halt waits in Redis, where FLUSHALL
            # drops it, as a Redis restarted empty would. (A fixed 1.5 s wait let a late BRPOP take it, on a
            # loaded host.)
            with _frozen(agent):
                wait_until(lambda: client.info("clients")["blocked_clients"] == 0, timeout=30,
                           message="the frozen agent's consumers to have no BRPOP waiting in Redis")
                asked = time.monotonic()
                deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
                client.flushall()
                COUNTS["redis_flushed_after_stop"] += 1
            figure("lost_halt_s", _stopped(d, fake_model, asked))
            COUNTS["lost_halts_survived"] += 1
        assert _redriven(agent, "deployments.deployment_halt") == KILLS
        # Work sent after the flush still reaches the agent (the queues' routes are declared again).
        d = _ready(model, node, d)
        asked = time.monotonic()
        deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
        figure("halt_sent_s", _stopped(d, fake_model, asked))
        assert _redriven(agent, "deployments.deployment_halt") == KILLS  # the queue's halt stopped it
    finally:
        stop_leftover_engines(tmp_path)


BUSY_REPOS = ("one", "two", "three", "four")  # one download per worker thread of the agent (nodeagent's --concurrency 4)


@pytest.fixture
def slow_hub(tmp_path):
    """A Hugging Face double serving four 12 MB repos at 200 KB/s: each download holds a thread for a minute."""
    root = tmp_path / "hub"
    for name in BUSY_REPOS:
        repo = root / "acme" / name
        repo.mkdir(parents=True)
        (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
        (repo / "model.safetensors").write_bytes(os.urandom(12 * MB))
    with serve(root) as url:
        configure(url, throttle_bps=200_000)
        yield url


@pytest.mark.timeout(180)
def test_a_stop_and_a_plan_run_at_once_while_downloads_hold_every_host_thread(
        process_env, spawn, unique, tmp_path, settings, fake_model, slow_hub, figure):
    """Engine control and plans have threads of their own in the agent (plumbing/pool.py): with a download
    on each of its 4 host threads (nodeagent's --concurrency) and a minute of each left, a Stop's halt and a
    deploy's plan are taken from their queues and run, not re-driven (the agent's log), and both are done while
    the four downloads still run."""
    settings.HF_ENDPOINT = slow_hub
    env = agent_env(process_env, tmp_path, HF_ENDPOINT=slow_hub)
    agent = Agent(spawn, env, f"busy-{unique}", tmp_path / "store")  # 4 host threads (nodeagent's default)
    node = agent.start()
    try:
        model = add_fake_model(node, fake_model)
        d = _ready(model, node)
        copies = []
        for name in BUSY_REPOS:
            hub_model = ModelRepo.objects.create(repo_id=f"acme/{name}")
            in_thread(repos.model_inspect, hub_model.pk)
            copies.append(repos.model_download(ModelRepo.objects.get(pk=hub_model.pk), node))
        downloading = ModelCopy.objects.filter(pk__in=[c.pk for c in copies], state="downloading")
        wait_until(lambda: downloading.count() == len(BUSY_REPOS), timeout=30,
                   message="the downloads to hold the node queue's threads")
        asked = time.monotonic()
        deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
        figure("halt_behind_downloads_s", _stopped(d, fake_model, asked))
        assert downloading.count() == len(BUSY_REPOS), "the engine was stopped only once a download had ended"
        COUNTS["halts_behind_busy_queue"] += 1

        asked = time.monotonic()
        d = deploys.deployment_redeploy(Deployment.objects.get(pk=d.pk))
        assert settle(d, timeout=GUARD_S).status == "ready"
        figure("plan_behind_downloads_s", time.monotonic() - asked)
        COUNTS["plans_behind_busy_queue"] += 1
        # In this order: stopped and deployed again while the four downloads held the host threads, by the halt and
        # the plan the queue delivered (the re-drive, which would have run them past its bound, ran nothing).
        assert downloading.count() == len(BUSY_REPOS), "deployed again only once a download had ended"
        assert _redriven(agent, "deployments.deployment_halt") == _redriven(agent, "deployments.deployment_run") == 0
        for copy in copies:
            repos.model_copy_cancel(ModelCopy.objects.get(pk=copy.pk))
        deploys.deployment_stop(Deployment.objects.get(pk=d.pk))
        _stopped(d, fake_model, time.monotonic())
    finally:
        stop_leftover_engines(tmp_path)


@pytest.mark.timeout(90 + GUARD_S)
def test_a_lost_rank_halt_is_redriven_by_the_worker_nodes_agent(fault_agent, fake_model, unique, figure):
    """A multi-node deployment Stopping, its worker rank on this agent's node Stopping too (the Stop marks
    every rank), and the rank's halt never sent: the worker's agent halts its engine from the row."""
    worker = fault_agent.node
    model = add_fake_model(worker, fake_model)
    head = Node.objects.create(name=f"head-{unique}")  # its agent runs elsewhere: only the rank is this test's
    d = Deployment.objects.create(name=f"spread-{unique}", model=model, node=head, port=free_port(),
                                  master_port=free_port(), status="stopping")
    marker = f"rank-{unique}"
    engine = subprocess.Popen([str(FAKE_VLLM), "serve", str(fake_model), "--port", str(free_port())], cwd=fake_model,
                              env=dict(os.environ, PANEL_ENGINE=marker), start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    born = psutil.Process(engine.pid).create_time()
    rank = DeploymentRank.objects.create(deployment=d, node=worker, rank=1, state="stopping", pid=engine.pid,
                                         pgid=engine.pid, pid_create_time=born, marker=marker)
    asked = time.monotonic()
    wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=GUARD_S,
               message="the rank to be stopped")
    assert engine.wait(GUARD_S) is not None and not engines_under(fake_model)
    figure("lost_rank_halt_s", time.monotonic() - asked)
    assert _redriven(fault_agent, "deployments.rank_halt") == 1  # the re-drive halted it: nothing else was sent
    COUNTS["lost_rank_halts_survived"] += 1
