"""Redis stopped for FAULT_OUTAGE_S seconds (during a load, during a download, while idle) and PostgreSQL backends
terminated mid-plan: the node stays online (heartbeats go to the database), work in flight ends
in the true state, and the agent takes new work once Redis is back."""
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from deployments.models import Deployment, ModelCopy, ModelRepo, Node
from deployments.services import repos
from tests.conftest import in_thread, wait_until
from tests.faults.conftest import OUTAGE_S, sha256
from tests.hfserver import configure, serve
from tests.truestate import (COUNTS, Agent, add_fake_model, agent_env, assert_true_state, deploy, set_load, settle,
                             stop_and_check, stop_leftover_engines)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
MB = 1 << 20


def _outage(private_redis, node, figure) -> None:
    """Redis down for OUTAGE_S, and on until the agent has written two heartbeats since it went away (heartbeats go
    to the database: the node stays online). The deadline only guards against a hang; the widest gap between the
    heartbeats seen meanwhile is a figure (perf/fault_soak.py prints it), compared with nothing here."""
    private_redis.stop()
    COUNTS["redis_outages"] += 1
    down, back = timezone.now(), time.monotonic() + OUTAGE_S
    beats = set()

    def beating():
        beats.add(Node.objects.get(pk=node.pk).last_heartbeat)
        return time.monotonic() >= back and len({b for b in beats if b > down}) >= 2

    wait_until(beating, timeout=OUTAGE_S + 60, interval=0.2, message="two heartbeats written while Redis is down")
    private_redis.start()
    seen = sorted(b for b in beats if b > down)
    figure("heartbeat_gap_in_outage_s", max((b - a).total_seconds() for a, b in zip(seen, seen[1:])))


@pytest.fixture
def hub_repo(tmp_path):
    root = tmp_path / "hub"
    repo = root / "acme" / "outage"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (repo / "model.safetensors").write_bytes(os.urandom(12 * MB))
    with serve(root) as url:
        yield url, repo


@pytest.mark.timeout(120 + 6 * OUTAGE_S)
def test_redis_down_during_a_load_and_a_download_then_idle(private_redis, process_env, spawn, unique, tmp_path,
                                                           settings, fake_model, hub_repo, figure):
    url, source = hub_repo
    settings.HF_ENDPOINT = url
    env = agent_env(process_env, tmp_path, REDIS_URL=private_redis.url, HF_ENDPOINT=url)
    agent = Agent(spawn, env, f"redis-{unique}", tmp_path / "store")
    node = agent.start()
    model = add_fake_model(node, fake_model)

    # 1. A load and a download both in flight when Redis goes away.
    set_load(fake_model, OUTAGE_S / 3)
    d = deploy(model, node)
    hub_model = ModelRepo.objects.create(repo_id="acme/outage")
    in_thread(repos.model_inspect, hub_model.pk)
    hub_model.refresh_from_db()
    configure(url, throttle_bps=int(12 * MB / (OUTAGE_S / 2)))  # the download spans half the outage
    copy = repos.model_download(hub_model, node)
    wait_until(lambda: ModelCopy.objects.get(pk=copy.pk).state == "downloading", timeout=20, message="the download")
    wait_until(lambda: settle_state(d) == "loading", timeout=20, message="the load")
    _outage(private_redis, node, figure)
    assert settle(d, timeout=60).status == "ready"  # the load finished while Redis was away
    assert_true_state(d, fake_model)
    done = wait_until(lambda: (c := ModelCopy.objects.get(pk=copy.pk)).state in ("ready", "failed") and c,
                      timeout=90, message="the download")
    assert done.state == "ready", done.error
    assert sha256(Path(done.path) / "model.safetensors") == sha256(source / "model.safetensors")

    # 2. Idle: nothing in flight. Heartbeats go on, and work queued after Redis is back runs.
    _outage(private_redis, node, figure)
    stop_and_check(d, fake_model, timeout=60)  # a task sent after the outage reaches the agent
    stop_leftover_engines(tmp_path)


def settle_state(d):
    return Deployment.objects.get(pk=d.pk).status


@pytest.mark.postgres_only  # SQLite has no server backends to terminate
@pytest.mark.timeout(180)
def test_postgresql_backends_terminated_mid_plan_end_in_the_true_state(fault_agent, fake_model):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    set_load(fake_model, 4.0)
    d = deploy(model, node)
    # Mid-plan: the agent is following the load (it has read the engine's first shard line).
    wait_until(lambda: (Deployment.objects.get(pk=d.pk).load_percent or 0) > 0, timeout=30,
               message="the load to be followed")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        terminated = cursor.fetchone()[0]
    assert terminated >= 1
    COUNTS["pg_backends_terminated"] += terminated
    row = settle(d, timeout=60)
    assert row.status in ("ready", "failed")
    if row.status == "failed":
        assert "OperationalError" in row.status_message or "InterfaceError" in row.status_message, row.status_message
    assert_true_state(d, fake_model)
    # The agent reconnects by itself: it heartbeats and takes new work.
    wait_until(lambda: Node.objects.get(pk=node.pk).last_heartbeat > timezone.now() - timedelta(seconds=2),
               timeout=20, message="heartbeats after the backends were terminated")
    stop_and_check(d, fake_model)
    again = deploy(model, node)
    assert settle(again, timeout=30).status == "ready"
    stop_and_check(again, fake_model)
