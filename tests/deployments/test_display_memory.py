"""A display server on the chosen GPUs (Xorg, gnome-shell: NVML's graphics processes) is never stopped and never
waited for, and its memory is not the engine's: the fit and the KV estimate count it as taken. The plan runs with
the real memory wait against the NVML double (tests/nvmldouble.py), its other host boundaries replaced as in
tests/deployments/test_deploys.py."""
import json
import os
import time
from pathlib import Path
from unittest import mock

import pytest

from deployments import kvcalibration
from deployments.host import gpu, gpuwait, processes
from deployments.models import Deployment, Node
from deployments.node import guards, plan
from deployments.services import fitgate
from tests.deployments import test_deploys
from tests.deployments.test_deploys import FakeHost, _clock, _queued
from tests.factories import DeploymentFactory, ModelRepoFactory
from tests.nvmldouble import GIB, MIB, FakeGpu, FakeNvml, proc

pytestmark = pytest.mark.django_db
S = Deployment.Status
CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
XORG = 2**22 + 5  # above Linux's PID_MAX_LIMIT: never a live process of this machine
HOLDER = 2**22 + 7
TOTAL = 141 * 10**9  # the node fixture's GPUs
node, model = test_deploys.node, test_deploys.model  # the plan tests' fixtures: a node of 8 GPUs, a model copied there


@pytest.fixture
def nvml(monkeypatch):
    fake = FakeNvml([FakeGpu(f"GPU-{i}", drain_s=1.0) for i in range(8)])
    for g in fake.gpus:
        g.used = 0  # beside its processes an idle GPU reads 0 used (v2, as on a real H100)
    monkeypatch.setattr(gpu, "pynvml", fake)
    monkeypatch.setattr(gpu, "_session", None)
    return fake


@pytest.fixture
def host(tmp_path, settings, monkeypatch, nvml):
    """FakeHost, but NVML is the double's and the memory wait is the real one (with a short timeout)."""
    settings.VAR_DIR = tmp_path
    monkeypatch.setattr(plan, "MEMORY_TIMEOUT_S", 3.0)
    fake = FakeHost(tmp_path)
    for name in [n for n in fake.mocks if n.startswith(("gpu.", "gpuwait."))]:
        del fake.mocks[name]
    fake._patchers = [mock.patch(f"deployments.host.{name}", new) for name, new in fake.mocks.items()]
    with _clock(time.monotonic), fake:
        yield fake


def test_a_deploy_on_a_gpu_a_display_server_holds_goes_ready_naming_what_was_not_waited_for(model, node, host, nvml):
    nvml.gpus[0].graphics = [proc(XORG, 512 * MIB)]
    nvml.names[XORG] = "/usr/lib/xorg/Xorg"
    d = _queued(model, node)

    plan.deployment_run(d.pk)

    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    waited = d.events.get(step="gpu_memory").message
    assert f"GPU 0: Xorg (PID {XORG}) holds 512 MiB; a display server, not waited for" in waited
    assert [p.pid for p in nvml.gpus[0].graphics] == [XORG]  # never stopped


def test_the_engine_starts_once_the_stopped_engines_memory_is_back_not_only_gone_from_the_list(model, node, host, nvml):
    holder = DeploymentFactory(node=node, status=S.READY, pid=HOLDER, pgid=HOLDER, port=9000, name="old")
    holder.gpus.set(node.gpus.filter(index__in=[1]))
    nvml.gpus[1].compute = [proc(HOLDER, 30 * GIB)]
    nvml.gpus[0].graphics = [proc(XORG, 512 * MIB)]

    def stop(pgid, term_s, kill_s):
        nvml.gpus[1].exit(HOLDER)  # off the lists at once; its 30 GiB come back over a second
        return processes.StopResult(["SIGTERM"], 0.4, [], [])

    seen = {}

    def launch(spec):
        seen.update({s.index: s.memory_used for s in gpu.sample([0, 1])})
        return host.launch(spec)

    host.mocks["processes.stop"].side_effect = stop
    host.mocks["processes.launch"].side_effect = launch
    d = _queued(model, node)

    plan.deployment_run(d.pk)

    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    # The engine started with GPU 1's memory back (give or take what the wait lets go unexplained), Xorg's held.
    assert seen[0] == 512 * MIB and seen[1] <= gpuwait.UNEXPLAINED_BYTES


def test_the_node_records_a_graphics_process_as_a_display_server_with_its_memory_per_gpu(node, nvml):
    me = os.getpid()  # a live process, so that it can be described
    nvml.gpus[0].graphics = [proc(me, 512 * MIB)]

    found = guards.foreign_holders(node.pk, [0, 1])

    assert [(p["pid"], p["display"], p["gpu_memory"]) for p in found] == [(me, True, {"0": 512 * MIB})]


def _xorg(memory=512 * MIB, **kw):
    return {"pid": XORG, "user": "root", "name": "Xorg", "command": "/usr/lib/xorg/Xorg :0", "memory": memory,
            "gpus": [0], "display": True, "deployment": None, **kw}


def test_the_fit_and_the_kv_estimate_count_a_display_servers_memory_as_taken(node):
    stranger = {**_xorg(40 * GIB), "pid": 4321, "name": "python", "command": "python train.py", "display": False}
    Node.objects.filter(pk=node.pk).update(foreign_processes=[_xorg(gpu_memory={"0": 512 * MIB}), stranger])
    node.refresh_from_db()
    config = json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
    llama = ModelRepoFactory(config=config, files=[{"path": "model.safetensors", "size": 16 * 10**9}])

    on_xorg, beside = fitgate.model_fit(llama, node, 1, gpu_indices=[0]), fitgate.model_fit(llama, node, 1, gpu_indices=[1])

    assert on_xorg.budget_per_gpu == int((TOTAL - 512 * MIB) * 0.9)
    assert beside.budget_per_gpu == int(TOTAL * 0.9)  # a stranger is stopped or refused, never counted
    assert kvcalibration.memory_of(node, {}, [0, 1], {})["gpu_memory_bytes"] == [TOTAL - 512 * MIB, TOTAL]


def test_a_record_without_memory_per_gpu_counts_the_display_servers_memory_on_its_gpu(node):
    Node.objects.filter(pk=node.pk).update(foreign_processes=[_xorg()])  # recorded by an older agent
    node.refresh_from_db()
    assert kvcalibration.memory_of(node, {}, [0], {})["gpu_memory_bytes"] == [TOTAL - 512 * MIB]
