"""A persisted deployment survives reboots and crashes: its engine runs under a systemd unit (through the systemctl
double tests/faults/systemd/systemctl, which speaks systemctl's command line and semantics with real processes:
enable/disable/start/stop/show/is-active, Restart=on-failure after RestartSec, "boot" = start every enabled unit).

- Reboot: the agent, every engine and every unit are SIGKILLed at once; the units start their engines again before
  (odd runs) or after (even runs) the agent comes back. Each time the deployment ends ready with exactly one engine,
  the unit's main process, adopted (proven by its marker), its load followed again (loading, then ready), nothing
  else of the fake engine's running. FAULT_REBOOTS times (perf/reboot_soak.py runs 10 at random moments).
- Crash of the persisted engine: systemd (the owner of a persisted engine's restarts) starts it once, the panel does
  not (its auto-restart is on and counts no restart), and the deployment is ready again.
The engine is tests/faults/fakevllm."""
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from django.utils import timezone

from deployments.host import ownership
from deployments.models import Deployment, DeploymentEvent, ModelCopy, Node
from deployments.services import deploys
from tests.conftest import wait_until
from tests.helpers import pid_alive
from tests.truestate import COUNTS, Agent, add_fake_model, agent_env, deploy, random_moment, set_load, settle

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
REBOOTS = int(os.environ.get("FAULT_REBOOTS", "2"))
DOUBLE = Path(__file__).parent / "systemd"


@pytest.fixture
def units(tmp_path, monkeypatch):
    """The double's environment: where units are written and its state kept; this process runs it too."""
    env = {"PATH": f"{DOUBLE}:{os.environ['PATH']}", "SYSTEMD_UNIT_PATH": str(tmp_path / "units"),
           "SYSTEMCTL_DOUBLE_STATE": str(tmp_path / "systemd-state"), "ENGINE_UNIT_RESTART_SEC": "1"}
    (tmp_path / "units").mkdir()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield env
    state = tmp_path / "systemd-state"
    for f in state.glob("*.json"):  # no supervisor outlives the test
        _kill_pids([_read_json(f).get("supervisor")])
    for f in state.glob("*.enabled"):
        f.unlink()


def _read_json(path):
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _kill_pids(pids):
    for pid in pids:
        try:
            if pid:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _systemctl(*args):
    import subprocess

    return subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=60)


def _show(unit):
    out = _systemctl("show", "-p", "MainPID,ActiveState,UnitFileState,NRestarts", unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _engines(marker):
    """Engine leaders carrying the deployment's marker."""
    return ownership.engines_marked(marker)


def _persisted(agent, model):
    wait_until(lambda: Node.objects.get(pk=agent.node.pk).systemd, timeout=30, message="the node to report systemd")
    d = deploy(model, Node.objects.get(pk=agent.node.pk))
    assert settle(d, timeout=60).status == "ready"
    serving, loads = Deployment.objects.get(pk=d.pk).pid, DeploymentEvent.objects.filter(deployment=d, step="load").count()
    deploys.deployment_persist(Deployment.objects.get(pk=d.pk))
    wait_until(lambda: DeploymentEvent.objects.filter(deployment=d, step="persist", message__startswith="Installed")
               .exists(), timeout=60, message="the unit installed")
    row = Deployment.objects.get(pk=d.pk)
    # No second load: the engine that served keeps serving, the unit enabled for its next start.
    assert row.systemd_unit and row.status == "ready" and row.pid == serving, (row.status, row.pid, serving)
    assert _show(row.systemd_unit)["UnitFileState"] == "enabled" and _show(row.systemd_unit)["MainPID"] == "0"
    assert DeploymentEvent.objects.filter(deployment=d, step="load").count() == loads
    return row


def _reboot(agent, d, tmp_path, units_first: bool):
    """SIGKILL the agent, every engine and every unit at once; boot (start every enabled unit), before or after
    the agent comes back."""
    state = tmp_path / "systemd-state"
    supervisors = [_read_json(f).get("supervisor") for f in state.glob("*.json")]
    groups = {os.getpgid(p) for p in ownership.find(d.marker) if pid_alive(p)}
    os.killpg(agent.proc.pid, signal.SIGKILL)
    _kill_pids(supervisors)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    agent.proc.wait(10)
    wait_until(lambda: not ownership.find(d.marker), timeout=10, message="every engine to be gone")
    if units_first:
        assert _systemctl("__boot").returncode == 0
        agent.start()
    else:
        agent.start()
        time.sleep(random_moment(0.0, 2.0))
        assert _systemctl("__boot").returncode == 0
    COUNTS["reboots"] += 1


def _one_adopted_engine(d, since):
    """Ready again after `since` (a reboot or a crash), with the unit's engine adopted since then."""
    wait_until(lambda: DeploymentEvent.objects.filter(deployment=d, step="adopted", started__gte=since).exists()
               or Deployment.objects.get(pk=d.pk).status in ("failed", "stopped"), timeout=90, message="the adoption")
    row = wait_until(lambda: (r := Deployment.objects.get(pk=d.pk)).status in ("ready", "failed", "stopped") and r,
                     timeout=90, message="ready again")
    assert row.status == "ready", row.status_message
    engines = _engines(row.marker)
    main = int(_show(row.systemd_unit)["MainPID"])
    assert engines == [main] == [row.pid], (engines, main, row.pid)
    # The unit starts the engine in its model's folder, as the agent does (a relative file flag reads from there).
    assert psutil.Process(row.pid).cwd() == ModelCopy.objects.get(model=row.model, node=row.node).path
    return row


@pytest.mark.timeout(120 + 60 * REBOOTS)
def test_a_persisted_deployment_comes_back_ready_after_each_reboot_adopted_never_killed(process_env, spawn, unique,
                                                                                     tmp_path, fake_model, units):
    agent = Agent(spawn, agent_env(process_env, tmp_path, **units), f"boot-{unique}", tmp_path / "store")
    agent.start()
    model = add_fake_model(agent.node, fake_model)
    set_load(fake_model, 1.0)
    d = _persisted(agent, model)
    for run in range(REBOOTS):
        if run:  # a random moment: while the last boot's load is followed, or once ready again
            time.sleep(random_moment(0.0, 2.0))
        since = timezone.now()
        _reboot(agent, d, tmp_path, units_first=bool(run % 2 == 0))
        d = _one_adopted_engine(d, since)
        adopted = DeploymentEvent.objects.filter(deployment=d, step="adopted", started__gte=since).last()
        assert "proven by its marker" in adopted.message
        assert DeploymentEvent.objects.filter(deployment=d, step="load", started__gte=adopted.started).exists()
        assert d.restarts == 0
    deploys.deployment_stop(d)
    row = settle(d, timeout=60, states={"stopped", "failed"})
    assert row.status == "stopped" and _engines(d.marker) == []
    assert _show(d.systemd_unit)["UnitFileState"] == "disabled" and _show(d.systemd_unit)["ActiveState"] == "inactive"


@pytest.mark.timeout(180)
def test_a_crashed_persisted_engine_is_restarted_once_by_systemd_and_ready_again(process_env, spawn, unique, tmp_path,
                                                                               fake_model, units):
    agent = Agent(spawn, agent_env(process_env, tmp_path, **units), f"crash-{unique}", tmp_path / "store")
    agent.start()
    model = add_fake_model(agent.node, fake_model)
    set_load(fake_model, 1.0)
    d = _persisted(agent, model)
    Deployment.objects.filter(pk=d.pk).update(auto_restart=True)  # the panel's own restart must not add a second
    # The engine that served when it was persisted ran outside the unit: systemd would not start it again, the agent
    # starts the unit; the next crash is the unit's engine's, which systemd restarts itself.
    since = timezone.now()
    os.killpg(d.pgid, signal.SIGKILL)
    row = _one_adopted_engine(d, since)
    assert DeploymentEvent.objects.filter(deployment=d, step="unit_start", started__gte=since).exists()
    assert int(_show(d.systemd_unit)["NRestarts"]) == 0 and row.restarts == 0 and row.pid != d.pid
    before, since = int(_show(d.systemd_unit)["NRestarts"]), timezone.now()
    os.killpg(row.pgid, signal.SIGKILL)
    again = _one_adopted_engine(row, since)
    assert int(_show(d.systemd_unit)["NRestarts"]) == before + 1
    assert not DeploymentEvent.objects.filter(deployment=d, step="unit_start", started__gte=since).exists()
    assert again.restarts == 0 and again.pid != row.pid
    row = again
    COUNTS["persisted_crashes"] += 1
    deploys.deployment_stop(row)
    assert settle(d, timeout=60, states={"stopped", "failed"}).status == "stopped" and _engines(d.marker) == []


def test_two_starts_of_one_unit_at_once_start_it_once_as_systemd_does(units, tmp_path):
    """The boot and a returning agent both start an enabled unit: systemd queues the second start behind the first and
    it finds the unit active. The double started two supervisors, so two engines (a reboot test saw two leaders with
    the deployment's marker and MainPID 0)."""
    import subprocess
    import sys

    tag = f"double-start-{os.getpid()}"
    (Path(units["SYSTEMD_UNIT_PATH"]) / "twice.service").write_text(
        f"[Service]\nExecStart={sys.executable} -c 'import time; time.sleep(300)' {tag}\nRestart=no\n")
    starts = [subprocess.Popen(["systemctl", "start", "twice.service"]) for _ in range(4)]
    assert [p.wait(30) for p in starts] == [0, 0, 0, 0]
    try:
        running = [p for p in psutil.process_iter(["cmdline"]) if tag in (p.info["cmdline"] or [])]
        assert len(running) == 1, running
        show = subprocess.run(["systemctl", "show", "-p", "MainPID", "--value", "twice.service"], capture_output=True,
                              text=True, check=True)
        assert int(show.stdout) == running[0].pid
    finally:
        subprocess.run(["systemctl", "stop", "twice.service"], check=True, timeout=60)
