"""The node agent's loop, with NVML replaced at the host/gpu.py boundary."""
import time
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from unittest import mock

import pytest
from django.utils import timezone

from deployments import history, payloads
from deployments.agent import Agent
from deployments.host import gpu
from deployments.models import Node, NodeMetric
from tests.conftest import wait_until
from tests.factories import DeploymentFactory

pytestmark = pytest.mark.django_db

GiB = 2**30


def _info(i):
    return gpu.GpuInfo(index=i, uuid=f"GPU-{i}", name="NVIDIA H200", memory_total=141 * GiB, compute_capability="9.0")


def _sample(i, used_gib=10, procs=(), power=None):
    return gpu.GpuSample(index=i, uuid=f"GPU-{i}", memory_total=141 * GiB, memory_used=used_gib * GiB,
                         memory_free=(141 - used_gib) * GiB, util_gpu=50, util_memory=20, temperature_c=40,
                         power_w=power, power_limit_w=700.0, sm_clock_mhz=1980, pcie_gen=5, pcie_width=16,
                         processes=list(procs))


@pytest.fixture(autouse=True)
def no_engine_report():
    """Asking `vllm serve --help=all` is the engine's business, tested in tests/host; the store's measurement and
    the host doctor that follow it in the same thread have their own tests. Left running, that thread outlived the
    test that registered the agent and wrote into the next one's database (CI: "Database access not allowed" from
    thread engine-report during a later test)."""
    with mock.patch.object(Agent, "_report_engine", autospec=True) as report:
        yield report


@pytest.fixture
def nvml():
    with mock.patch("deployments.host.gpu.inventory", autospec=True) as inventory, \
         mock.patch("deployments.host.gpu.sample", autospec=True) as sample:
        inventory.return_value = [_info(0), _info(1)]
        sample.return_value = [_sample(0), _sample(1)]
        yield sample


@pytest.fixture
def agent(nvml, tmp_path, unique):
    agent = Agent(name=f"agent-{unique}", model_store=str(tmp_path), address="10.0.0.9", version="t",
                  sample_seconds=1, heartbeat_seconds=5)
    agent.register()
    return agent


@pytest.fixture
def published():
    with mock.patch("plumbing.live.publishing.publish", autospec=True) as publish:
        yield publish


def test_register_creates_the_node_and_its_gpus(agent):
    node = Node.objects.get(name=agent.name)
    assert node.queue == f"node.{agent.name}"
    assert [(g.index, g.name, g.memory_total) for g in node.gpus.all()] == [(0, "NVIDIA H200", 141 * GiB), (1, "NVIDIA H200", 141 * GiB)]
    assert node.online and node.address == "10.0.0.9"


def test_a_tick_publishes_every_gpu_with_unknown_fields_as_none(agent, published):
    sample = agent.tick()
    topic, kind, data = published.call_args_list[-1].args[:3]
    assert (topic, kind) == (payloads.node_topic(agent.node_id), "sample")
    assert [g["memory_used"] for g in data["gpus"]] == [10 * GiB, 10 * GiB]
    assert data["gpus"][0]["power_w"] is None  # NVML refused: shown as unknown, not 0
    assert data["disk"]["total"] > 0 and sample["host"]["ram_total"] > 0


def test_a_gpu_process_is_labelled_with_the_deployment_whose_process_group_it_is_in(agent, nvml, published):
    import os

    deployment = DeploymentFactory(node_id=agent.node_id, status="ready", pid=os.getpid(), pgid=os.getpgid(os.getpid()))
    nvml.return_value = [_sample(0, 60, procs=[gpu.GpuProcess(pid=os.getpid(), used_memory=50 * GiB, name="python")]),
                         _sample(1, 0, procs=[gpu.GpuProcess(pid=999_999_999, used_memory=GiB, name="stray")])]
    data = agent.tick()
    owned, stray = data["gpus"][0]["processes"][0], data["gpus"][1]["processes"][0]
    assert owned["deployment"] == {"id": deployment.pk, "name": deployment.name}
    assert stray["deployment"] is None and stray["pgid"] is None


def test_heartbeats_follow_their_own_interval(agent, published):
    Node.objects.filter(pk=agent.node_id).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    agent.tick(now=1000.0)
    beat = Node.objects.get(pk=agent.node_id).last_heartbeat
    assert timezone.now() - beat < timedelta(seconds=5)
    agent.tick(now=1002.0)  # 2 s later: no heartbeat yet
    assert Node.objects.get(pk=agent.node_id).last_heartbeat == beat
    agent.tick(now=1005.5)
    assert Node.objects.get(pk=agent.node_id).last_heartbeat > beat


def test_a_node_without_nvml_says_so_and_still_reports_disk(tmp_path, published, client, viewer, unique):
    with mock.patch("deployments.host.gpu.inventory", autospec=True, side_effect=gpu.NvmlUnavailable("NVML Shared Library Not Found")):
        agent = Agent(name=f"cpu-{unique}", model_store=str(tmp_path), address="", version="t")
        agent.register()
    data = agent.tick()
    assert data["gpus"] == [] and "NVML Shared Library Not Found" in data["nvml_error"]
    client.force_login(viewer)
    page = client.get(f"/nodes/{agent.node_id}/").content.decode()
    assert "No NVIDIA GPU on this node." in page


@pytest.mark.django_db(transaction=True)  # the loop thread writes heartbeats on its own connection
def test_one_failing_sample_does_not_stop_the_loop(agent, nvml, published):
    import threading

    nvml.side_effect = [RuntimeError("driver hiccup"), [_sample(0), _sample(1)], [_sample(0), _sample(1)]] + [[_sample(0)]] * 50
    agent.sample_seconds = 0.01
    stop = threading.Event()
    thread = threading.Thread(target=agent.loop, args=(stop,))
    thread.start()
    try:
        wait_until(lambda: nvml.call_count >= 3, timeout=10, message="samples after the failure")
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_the_last_hour_is_kept_at_full_rate_and_bounded(agent, published):
    for k in range(70):
        sample = agent.sample()
        sample["t"] = 1_000_000 + k
        history.push(agent.node_id, sample, sample_seconds=60)  # 60 s interval: room for 60 samples
    kept = history.recent(agent.node_id)
    assert len(kept) == 60 and kept[-1]["t"] == 1_000_069
    assert history.recent(agent.node_id, since=1_000_065)[0]["t"] == 1_000_066


def test_minutes_fold_into_one_row_each_and_old_rows_expire(agent):
    aggregator = history.MinuteAggregator()
    start = (int(time.time()) // 60) * 60 - 120
    closed = []
    for k, used in enumerate([10, 20, 30]):
        sample = agent.sample()
        sample["t"] = start + k
        sample["gpus"][0]["memory_used"] = used * GiB
        assert aggregator.add(sample) is None
    sample["t"] = start + 60
    closed.append(aggregator.add(sample))
    minute = closed[0]
    assert minute["t"] == start and minute["samples"] == 3
    assert minute["gpus"][0]["memory_used"] == 20 * GiB and minute["gpus"][0]["memory_used_max"] == 30 * GiB
    NodeMetric.objects.create(node_id=agent.node_id, t=timezone.now() - timedelta(days=8), data={})
    history.record_minute(agent.node_id, minute)
    assert list(NodeMetric.objects.filter(node_id=agent.node_id).values_list("t", flat=True)) == [
        datetime.fromtimestamp(start, tz=dt_timezone.utc)]
    rows = history.minutes(agent.node_id, timedelta(days=7))
    assert rows[0]["gpus"][0]["memory_used_max"] == 30 * GiB


def test_the_history_endpoint_serves_recent_samples_and_minutes(agent, published, viewer_client):
    agent.tick()
    data = viewer_client.get(f"/nodes/{agent.node_id}/history.json").json()
    assert data["resolution"] == 1 and data["samples"][-1]["gpus"][0]["memory_used"] == 10 * GiB
    assert viewer_client.get(f"/nodes/{agent.node_id}/history.json?days=7").json()["resolution"] == 60
    assert viewer_client.get(f"/nodes/{agent.node_id}/history.json?since=abc").status_code == 400


def test_host_work_is_sent_to_the_nodes_own_queue_after_commit(sent_tasks):
    from deployments.dispatch import node_enqueue
    from tests.factories import NodeFactory

    node = NodeFactory(name="gpu-09")
    node_enqueue(node, "deployments.node_ping")
    assert not sent_tasks  # nothing leaves before the transaction commits
    assert sent_tasks.commit().one("deployments.node_ping").queue == "node.gpu-09"


def test_a_sample_carries_the_hosts_cpu_and_network_rates_and_the_heartbeat_its_ram_and_cores(agent, published):
    first = agent.tick(now=10_000.0)
    time.sleep(0.05)
    second = agent.tick(now=10_001.0)
    assert first["host"]["net_rx_bps"] is None  # no rate before a second reading
    assert second["host"]["net_rx_bps"] >= 0 and second["host"]["net_tx_bps"] >= 0
    assert 0 <= second["host"]["cpu_percent"] <= 100 and second["host"]["cpu_count"] >= 1
    node = Node.objects.get(pk=agent.node_id)
    assert node.ram_total == second["host"]["ram_total"] and node.cpu_count == second["host"]["cpu_count"]
    kept = history.latest(agent.node_id)
    assert kept["cpu_percent"] == second["host"]["cpu_percent"] and kept["ram_total"] == node.ram_total


def test_a_new_agent_replaces_what_the_previous_one_recorded_of_foreign_holders_and_listeners(agent, published):
    # The previous agent recorded a foreign vLLM on the GPUs and a program on a port; both are gone now. A new agent
    # whose first reading is empty stored nothing (it compared with an empty list of its own), and deploys stayed
    # refused for engines that no longer ran.
    stale_holder = {"pid": 999_999, "user": "alice", "command": "vllm serve old", "gpus": [0], "memory_mib": 40_960}
    stale_port = {"port": 18771, "pid": 999_998, "user": "root", "command": "python3 -m http.server 18771",
                  "deployment": None, "engine": False}
    Node.objects.filter(pk=agent.node_id).update(foreign_processes=[stale_holder], listeners=[stale_port])
    with mock.patch("deployments.node.guards.foreign_holders", return_value=[]), \
         mock.patch("deployments.host.listeners.host_listeners", return_value={}):
        agent.tick()
    node = Node.objects.get(pk=agent.node_id)
    assert (node.foreign_processes, node.listeners) == ([], [])


def test_an_engine_installed_after_the_agent_started_is_reported_at_the_next_heartbeat(agent, published, tmp_path,
                                                                                      settings, no_engine_report):
    # `scripts/install-engine` after `./panel start`: the deploy form still said "no engine" minutes later.
    settings.VLLM_BIN = str(tmp_path / "engine" / "bin" / "vllm")
    now = time.monotonic()
    agent.tick(now)  # no engine: noted
    reports = no_engine_report.call_count
    agent.tick(now + agent.heartbeat_seconds)
    assert no_engine_report.call_count == reports  # nothing changed, nothing asked again
    (tmp_path / "engine" / "bin").mkdir(parents=True)
    (tmp_path / "engine" / "bin" / "vllm").write_text("#!/bin/sh\n")
    (tmp_path / "engine" / "bin" / "vllm").chmod(0o755)
    agent.tick(now + 2 * agent.heartbeat_seconds)
    wait_until(lambda: no_engine_report.call_count == reports + 1, timeout=10, message="the engine reported again")
