"""Ownership by descent, and "stop other processes" signalling exactly the holders.

Processes here are real: a marker in one process's environment, children without it (as vLLM's titled
EngineCore and workers show none once setproctitle wrote over it), a holder in a shell's session with a
sibling. GPU holders are faked at NVML's boundary (gpu.processes_on), as the other foreign-holder tests do."""
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deployments.host import ownership
from deployments.models import Deployment, Node
from deployments.node import guards, plan
from deployments.services import deploys
from plumbing.errors import ServiceError
from tests.conftest import wait_until
from tests.deployments.test_deploys import _queued, host, model, node  # noqa: F401
from tests.factories import DeploymentFactory, NodeFactory
from tests.helpers import pid_alive

pytestmark = pytest.mark.django_db
S = Deployment.Status

# A parent that starts a child without its environment (vLLM's EngineCore, once titled: /proc/<pid>/environ
# no longer shows what it inherited), titled like vLLM's, and prints the child's PID.
TITLED_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "open('/proc/self/comm', 'w').write('VLLM::EngineCore'); import time; time.sleep(300)"], env={})
print(child.pid, flush=True)
time.sleep(300)
"""


@pytest.fixture
def procs():
    """Processes the test starts (each its own session), their whole sessions killed at the end."""
    started = []

    def start(argv, **kw):
        proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, text=True, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        for pid in psutil.pids():
            try:
                if os.getsid(pid) == proc.pid:
                    os.kill(pid, 9)
            except OSError:
                continue
        proc.wait()


def _titled_engine(procs, marker: str | None) -> tuple[int, int]:
    """(API server PID, its titled child's PID): the parent carries `marker` (None: no marker at all)."""
    env = {**os.environ, ownership.MARKER_VAR: marker} if marker else {k: v for k, v in os.environ.items()
                                                                       if k != ownership.MARKER_VAR}
    parent = procs([sys.executable, "-c", TITLED_CHILD], env=env)
    child = int(parent.stdout.readline())
    wait_until(lambda: psutil.Process(child).name().startswith("VLLM::"), timeout=10, message="the child titled")
    return parent.pid, child


def test_a_titled_child_without_the_marker_is_the_panels_when_its_parent_carries_it(procs, settings):
    """The finding on a CPU node: EngineCore showed no PANEL_ENGINE and was listed as foreign."""
    settings.CPU_HOST_EXCLUSIVE = True
    cpu = NodeFactory(name="cpu-descent")
    d = DeploymentFactory(node=cpu, status=S.READY, marker=ownership.new_marker(1))
    _, ours = _titled_engine(procs, d.marker)
    _, theirs = _titled_engine(procs, None)
    assert ownership.marker_of(ours) is None  # what the holder check saw before
    pids = [p["pid"] for p in guards.foreign_holders(cpu.pk, None)]
    assert ours not in pids and theirs in pids
    Deployment.objects.filter(pk=d.pk).update(status=S.STOPPED)  # a stopped deployment's engine is a stray
    stray = {p["pid"]: p for p in guards.foreign_holders(cpu.pk, None)}
    assert stray[ours]["deployment"] == d.pk and stray[theirs]["deployment"] is None
    # ... except to its own redeploy, and to a deploy that ticked it under "Also stop".
    assert ours not in [p["pid"] for p in guards.foreign_holders(cpu.pk, None, spare=[d.pk])]


def test_a_recorded_pid_whose_create_time_differs_is_not_proof(procs, settings):
    settings.CPU_HOST_EXCLUSIVE = True
    cpu = NodeFactory(name="cpu-born")
    d = DeploymentFactory(node=cpu, status=S.READY, marker=ownership.new_marker(2))
    parent, child = _titled_engine(procs, d.marker)
    born = psutil.Process(parent).create_time()
    Deployment.objects.filter(pk=d.pk).update(pid=parent, pid_create_time=born)
    assert child not in [p["pid"] for p in guards.foreign_holders(cpu.pk, None)]
    Deployment.objects.filter(pk=d.pk).update(pid_create_time=born - 60)  # a process on that PID a minute before
    assert child in [p["pid"] for p in guards.foreign_holders(cpu.pk, None)]


def test_a_redeploy_with_changes_is_not_refused_for_its_own_or_an_also_stopped_deployments_processes(
        model, node, sent_tasks):
    """The web side reads what the agent recorded: an entry naming the redeployed deployment (or one
    ticked under "Also stop") is not foreign; a stranger's still is."""
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.READY, engine_args={"max-model-len": 512})
    d.gpus.set(node.gpus.filter(index__in=[0]))
    other = DeploymentFactory(model=model, node=node, port=8001, status=S.STOPPED)
    entry = {"user": "root", "command": "VLLM::EngineCore", "name": "VLLM::EngineCore", "memory": 0, "gpus": [0],
             "display": False}
    Node.objects.filter(pk=node.pk).update(foreign_processes=[{**entry, "pid": 11, "deployment": d.pk},
                                                              {**entry, "pid": 12, "deployment": other.pk}])
    with pytest.raises(deploys.ForeignProcesses) as refused:
        deploys.deployment_redeploy(Deployment.objects.get(pk=d.pk), engine_args={"max-model-len": 256})
    assert [p["pid"] for p in refused.value.processes] == [12]
    redeployed = deploys.deployment_redeploy(Deployment.objects.get(pk=d.pk), engine_args={"max-model-len": 256},
                                             replace=[other.pk])
    assert redeployed.status == S.QUEUED
    Node.objects.filter(pk=node.pk).update(foreign_processes=[{**entry, "pid": 13, "deployment": None}])
    with pytest.raises(ServiceError):
        deploys.deployment_redeploy(Deployment.objects.get(pk=d.pk), engine_args={"max-model-len": 128})


# A shell (the session leader) that starts a sibling and the GPU holder, which has a child of its own.
SESSION = """
sleep 300 & echo "sibling $!" > {out}
bash -c 'sleep 300 & echo "child $!" >> {out}; exec sleep 301' & echo "holder $!" >> {out}
wait
"""


def test_stop_other_processes_ends_the_holder_and_its_child_only_and_the_timeline_names_them(
        model, node, host, procs, tmp_path):
    """The finding: the holder's whole process group and session were signalled (the shell that started it
    would have gone too), while the timeline named one PID."""
    out = tmp_path / "pids"
    shell = procs(["bash", "-c", SESSION.format(out=out)])
    wait_until(lambda: out.exists() and len(out.read_text().split("\n")) > 3, timeout=10, message="the session up")
    pids = {k: int(v) for k, v in (line.split() for line in out.read_text().splitlines())}
    wait_until(lambda: "301" in " ".join(psutil.Process(pids["holder"]).cmdline()), timeout=10, message="exec")
    assert os.getsid(pids["sibling"]) == os.getsid(pids["holder"]) == shell.pid
    from deployments.host import gpu
    host.mocks["gpu.processes_on"].return_value = {0: [gpu.GpuProcess(pid=pids["holder"], used_memory=1 << 30,
                                                                      name="sleep")]}
    d = _queued(model, node, stop_foreign=True)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    assert not pid_alive(pids["holder"]) and not pid_alive(pids["child"])
    assert pid_alive(pids["sibling"]) and pid_alive(shell.pid)
    message = d.events.get(step="stop_others").message
    assert f"PID {pids['holder']} of " in message and "sleep 301" in message
    assert f"PID {pids['child']} of " in message and f"a child of PID {pids['holder']}" in message
    assert str(pids["sibling"]) not in message and "SIGTERM" in message


def test_a_holder_that_ignores_sigterm_is_killed_on_the_deadline_and_the_agent_is_never_signalled(procs):
    stubborn = procs(["bash", "-c", "trap '' TERM; echo up; while :; do sleep 0.1; done"])
    assert stubborn.stdout.readline().strip() == "up"
    result = ownership.stop_holders([stubborn.pid], term_timeout_s=0.5, kill_timeout_s=5)
    assert result.signals == ["SIGTERM", "SIGKILL"] and result.survivors == [] and not pid_alive(stubborn.pid)
    assert stubborn.pid in [p["pid"] for p in result.signalled]
    with pytest.raises(ownership.RefusedToSignal):
        ownership.stop_holders([os.getppid()])
    assert Path(f"/proc/{os.getppid()}").exists()
