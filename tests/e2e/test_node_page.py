"""The node page in real Chromium: live charts, the process table, offline/online, reconnects."""
import os
import re
import signal
import time

import pytest
from playwright.sync_api import expect

from deployments.models import Node
from deployments.services import nodes
from tests.conftest import agent_argv, in_thread, wait_until
from tests.factories import DeploymentFactory, GpuFactory, NodeFactory

pytestmark = pytest.mark.e2e
GiB = 2**30


def _sample(t, used_gib, util, pid=None):
    procs = [{"pid": pid, "pgid": pid, "used_memory": used_gib * GiB, "name": "python3"}] if pid else []
    return {
        "t": t, "nvml_error": "",
        "gpus": [{"index": 0, "uuid": "GPU-0", "memory_total": 80 * GiB, "memory_used": used_gib * GiB,
                  "memory_free": (80 - used_gib) * GiB, "util_gpu": util, "util_memory": 1, "temperature_c": 41,
                  "power_w": None, "power_limit_w": 700.0, "sm_clock_mhz": 1980, "pcie_gen": 5, "pcie_width": 16,
                  "processes": procs}],
        "disk": {"total": 10**12, "free": 4 * 10**11, "used": 6 * 10**11},
        "host": {"ram_total": 64 * GiB, "ram_available": 32 * GiB, "load1": 0.5},
    }


def _record(node, sample, engines=None):
    in_thread(nodes.node_sample_record, node.pk, sample, engines or nodes.node_engines(node.pk))


def test_gpu_charts_move_live_and_recover_a_dropped_connection_without_a_gap(logged_in_page, unique):
    page = logged_in_page
    node = NodeFactory(name=f"gpu-{unique}", heartbeat_seconds=5)
    GpuFactory(node=node, index=0, memory_total=80 * GiB, name="NVIDIA H100")
    deployment = DeploymentFactory(node=node, status="ready", pid=4242, pgid=4242)
    now = time.time()
    _record(node, _sample(now - 2, 10, 5))
    page.goto(f"{page.base_url}/nodes/{node.pk}/")
    expect(page.locator("#live-state")).to_have_text("live")
    points = lambda: page.evaluate("window.nodeCharts.mem.data[0].length")  # noqa: E731
    assert points() == 1

    _record(node, _sample(now - 1, 40, 90, pid=4242))
    row = page.locator('#gpu-table tr[data-gpu="0"]')
    expect(row.locator('[data-f="mem"]')).to_have_text("40.0 GiB / 80.0 GiB")
    expect(row.locator('[data-f="util"]')).to_have_text("90 %")
    expect(row.locator('[data-f="power"]')).to_have_text("unknown / 700 W")
    expect(page.locator('#procs tr[data-pid="4242"]')).to_contain_text(deployment.name)
    assert points() == 2
    assert page.evaluate("window.nodeCharts.mem.data[1][1]") == 40

    # Drop the connection; samples taken meanwhile must appear after the reconnect.
    page.evaluate("Live.socket().close()")
    expect(page.locator("#live-state")).to_have_text("reconnecting")
    for k, used in enumerate([50, 60, 70]):
        _record(node, _sample(now + k, used, 50))
    expect(page.locator("#live-state")).to_have_text("live", timeout=15000)
    expect(row.locator('[data-f="mem"]')).to_have_text("70.0 GiB / 80.0 GiB")
    wait_until(lambda: points() == 5, timeout=10, message="the missed samples in the chart")
    assert page.evaluate("window.nodeCharts.mem.data[1]") == [10, 40, 50, 60, 70]


@pytest.mark.timeout(180)
def test_a_real_agent_without_gpus_streams_to_its_page_and_goes_offline_when_stopped(
        logged_in_page, process_env, spawn, unique, tmp_path):
    page = logged_in_page
    name = f"cpu-{unique}"
    argv = agent_argv(name, tmp_path, sample_seconds=0.5, heartbeat_seconds=1)
    agent = spawn(argv, process_env, name=name)
    node = wait_until(lambda: Node.objects.filter(name=name).first(), timeout=60, message="the agent")
    page.goto(f"{page.base_url}/nodes/{node.pk}/")
    expect(page.locator("#no-gpu")).to_contain_text("No NVIDIA GPU on this node.")
    last = page.locator("#last-sample")
    expect(last).not_to_have_text("—", timeout=10000)
    first = last.text_content()
    expect(last).not_to_have_text(first, timeout=10000)  # still moving
    expect(page.locator("#node-state")).to_have_text("online")

    os.killpg(agent.pid, signal.SIGKILL)
    expect(page.locator("#node-state")).to_have_text(re.compile("^offline since "), timeout=10000)
    spawn(argv, process_env, name=name + "-again")
    expect(page.locator("#node-state")).to_have_text("online", timeout=60000)


def test_a_multi_node_deployments_page_follows_every_nodes_gpu_memory_and_the_worker_page_names_the_rank(logged_in_page, unique):
    from deployments.models import DeploymentRank

    page = logged_in_page
    head, worker = NodeFactory(name=f"head-{unique}"), NodeFactory(name=f"worker-{unique}")
    for node in (head, worker):
        GpuFactory(node=node, index=0, memory_total=80 * GiB)
    d = DeploymentFactory(node=head, status="ready", master_port=29500, pid=4242, pgid=4242)
    d.gpus.set(head.gpus.all())
    DeploymentRank.objects.create(deployment=d, node=worker, rank=1, gpu_indices=[0], state="running", pid=5151, pgid=5151)
    page.goto(f"{page.base_url}/deployments/{d.pk}/")
    expect(page.locator("#live-state")).to_have_text("live")
    _record(head, _sample(time.time(), 12, 50))
    _record(worker, _sample(time.time(), 34, 50, pid=5151))
    expect(page.locator(f'#node-gpus tr[data-node="{head.pk}"] [data-f="mem"]')).to_have_text("12.0 GiB / 80.0 GiB")
    expect(page.locator(f'#node-gpus tr[data-node="{worker.pk}"] [data-f="mem"]')).to_have_text("34.0 GiB / 80.0 GiB")

    page.goto(f"{page.base_url}/nodes/{worker.pk}/")
    expect(page.locator("#ranks")).to_contain_text(d.name)
    expect(page.locator("#ranks")).to_contain_text(head.name)
    _record(worker, _sample(time.time(), 35, 50, pid=5151))
    expect(page.locator('#procs tr[data-pid="5151"]')).to_contain_text(f"{d.name} (rank 1)")
