"""The node page in real Chromium: live charts, the process table, offline/online, reconnects, and GPU memory from
NVML (the NVML double in a real agent process) to the chart."""
import os
import re
import signal
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from deployments.models import Node
from deployments.services import nodes
from tests.conftest import agent_argv, in_thread, wait_until
from tests.factories import DeploymentFactory, GpuFactory, NodeFactory
from tests.nvmldouble import MIB, TOTAL, SharedMemory

pytestmark = pytest.mark.e2e
GiB = 2**30
NVML_DOUBLE = Path(__file__).parent / "nvml_double"  # a pynvml that is the NVML double, for one agent's PYTHONPATH


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


def _memory_figure(used):
    """A GPU's memory as the node page's table writes it."""
    return f"{used / GiB:.1f} GiB / {TOTAL / GiB:.1f} GiB"


def _chart_series(page) -> dict[int, list[int]]:
    """Each GPU's line in the memory chart, in bytes (the chart holds GiB: bytes / 2**30, exact in a double)."""
    series = page.evaluate("NODE.gpus.map((gpu, k) => [gpu, nodeCharts.mem.data[k + 1]])")
    return {gpu: [round(v * GiB) for v in values] for gpu, values in series}


def _chart_last(page) -> dict[int, int | None]:
    """Each GPU's last point in the memory chart, in bytes (None: an empty line)."""
    return {gpu: values[-1] if values else None for gpu, values in _chart_series(page).items()}


@pytest.mark.timeout(240)
def test_gpu_memory_nvml_reports_through_a_real_agent_redis_and_channels_is_the_figure_and_the_chart_on_the_page(
        logged_in_page, process_env, spawn, unique, tmp_path):
    """A real node agent whose pynvml is the NVML double (8 H200s): the memory each GPU reports is what the node page
    shows in its table and as the chart's last point, and each change shows from the sample that read it on."""
    page = logged_in_page
    double = SharedMemory(tmp_path / "nvml")
    steps = [[(5 + 11 * i + 7 * k) * GiB + (97 * i + 31 * k + 3) * MIB for i in range(8)] for k in range(3)]
    double.set(steps[0])
    name = f"nvml-{unique}"
    env = dict(process_env, NVML_DOUBLE=str(double.folder), VLLM_BIN=str(tmp_path / "no-vllm"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(NVML_DOUBLE), process_env.get("PYTHONPATH")])))
    spawn(agent_argv(name, tmp_path / "store", sample_seconds=0.5, heartbeat_seconds=2), env, name=name)
    node = wait_until(lambda: Node.objects.filter(name=name).first(), timeout=60, message="the agent")
    assert sorted(node.gpus.values_list("uuid", flat=True)) == [f"GPU-double-{i}" for i in range(8)]
    page.goto(f"{page.base_url}/nodes/{node.pk}/")
    expect(page.locator("#live-state")).to_have_text("live")
    rows = {i: page.locator(f'#gpu-table tr[data-gpu="{i}"] [data-f="mem"]') for i in range(8)}

    # The double answers freely: the chart's last point is one of the last two figures it answered.
    for i in range(8):
        expect(rows[i]).to_have_text(_memory_figure(steps[0][i]), timeout=30000)
    last = _chart_last(page)
    for i in range(8):
        assert last[i] in double.reported(i)[-2:] and last[i] == steps[0][i]

    # Then sample by sample: the agent's next sample waits in the double while the test changes the memory, one
    # sample reads the new memory and is sent, and the next waits again. Nothing newer than that sample exists, so
    # the page must show it.
    double.set(steps[0], turns=0)
    turn = wait_until(double.waiting, timeout=30, message="the sampler to wait for the NVML double")
    for used in steps[1:]:
        double.set(used, turns=turn)
        wait_until(lambda turn=turn: double.waiting() == turn + 1, timeout=30, message="one sample of the new memory")
        turn += 1
        for i in range(8):
            assert double.reported(i)[-1] == used[i]
            expect(rows[i]).to_have_text(_memory_figure(used[i]), timeout=30000)
        last = _chart_last(page)
        assert last == {i: double.reported(i)[-1] for i in range(8)}

    # The chart followed every change in order, and holds nothing NVML did not answer.
    for gpu, values in _chart_series(page).items():
        changes = [v for k, v in enumerate(values) if k == 0 or v != values[k - 1]]
        assert changes == [step[gpu] for step in steps]
        assert set(values) <= set(double.reported(gpu))
