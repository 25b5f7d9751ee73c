"""A GPU holder's supervisor, read from its control group (deployments/host/supervisors.py), and the systemctl double
held to what systemd does with it: a unit's main process in /system.slice/NAME, Restart=always bringing back a
process SIGTERMed by PID, Restart=on-failure leaving it down (SIGTERM is a clean exit to systemd), and `systemctl
stop` ending it for good."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from deployments.host import supervisors, systemd
from tests.conftest import wait_until

DOUBLE = Path(__file__).parent.parent / "faults" / "systemd"
ID = "0123456789abcdef" * 4


@pytest.mark.parametrize("path, expected", [
    ("/system.slice/minimax.service", supervisors.Supervisor("systemd", "minimax.service")),
    ("/system.slice/vllm.slice/kimi.service", supervisors.Supervisor("systemd", "kimi.service")),
    ("/system.slice/minimax.service/payload", supervisors.Supervisor("systemd", "minimax.service")),
    (f"/system.slice/docker-{ID}.scope", supervisors.Supervisor("container", ID)),  # Docker, systemd driver
    (f"/docker/{ID}", supervisors.Supervisor("container", ID)),  # Docker, cgroupfs driver
    (f"/kubepods.slice/kubepods-pod1.slice/cri-containerd-{ID}.scope", supervisors.Supervisor("container", ID)),
    (f"/machine.slice/libpod-{ID}.scope/container", supervisors.Supervisor("container", ID)),  # Podman
    ("/user.slice/user-1000.slice/session-4.scope", None),  # a login shell: nothing brings it back
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service", None),  # a user's own manager
    ("/", None),
    ("", None),
])
def test_a_cgroup_path_names_the_unit_or_container_that_restarts_its_processes(path, expected):
    assert supervisors.parse(path) == expected


def test_a_holder_is_named_with_its_supervisor_and_its_restart_policy():
    holder = {"pid": 4242, "user": "ops", "command": "vllm serve MiniMax", "memory": 80 << 30,
              "supervisor": {"kind": "systemd", "name": "minimax.service", "restart": "always"}}
    assert supervisors.holder_text(holder) == (
        "PID 4242 (ops: vllm serve MiniMax, 81920 MiB; systemd unit minimax.service, restart always)")
    container = {**holder, "supervisor": {"kind": "container", "name": ID, "restart": "unless-stopped"}}
    assert supervisors.holder_text(container).endswith("; container 0123456789ab, restart unless-stopped)")
    assert supervisors.holder_text({**holder, "supervisor": None}) == "PID 4242 (ops: vllm serve MiniMax, 81920 MiB)"


@pytest.fixture
def unit(tmp_path, monkeypatch, unique):
    """A unit of the systemctl double, the Restart= policy its test writes; stopped at the end."""
    units = tmp_path / "units"
    units.mkdir()
    monkeypatch.setenv("PATH", f"{DOUBLE}:{os.environ['PATH']}")
    monkeypatch.setenv("SYSTEMD_UNIT_PATH", str(units))
    monkeypatch.setenv("SYSTEMCTL_DOUBLE_STATE", str(tmp_path / "state"))
    name = f"holder-{unique}.service"

    def write(restart: str) -> str:
        (units / name).write_text(f"[Service]\nExecStart=/bin/sleep 600\nRestart={restart}\nRestartSec=0.2\n")
        systemd.systemctl("daemon-reload")
        systemd.systemctl("start", name)
        return name

    yield write
    subprocess.run(["systemctl", "stop", name], timeout=60, check=False, env=os.environ)


def _show(name: str) -> dict:
    """The unit's MainPID, ActiveState and NRestarts, as `systemctl show` prints them."""
    out = systemd.systemctl("show", "-p", "MainPID,ActiveState,NRestarts", name)
    return dict(line.split("=", 1) for line in out.split())


def _main(name: str) -> int:
    return wait_until(lambda: int(_show(name)["MainPID"]), timeout=10, message=f"{name}'s main process")


def _cgroup_v2_writable() -> bool:
    return any((root / "cgroup.procs").exists() and os.access(root, os.W_OK)
               for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")))


@pytest.mark.skipif(not _cgroup_v2_writable(), reason="no writable cgroup v2 hierarchy for the double's units")
def test_the_doubles_unit_runs_in_its_control_group_and_is_read_as_its_supervisor(unit):
    name = unit("always")
    pid = _main(name)
    assert supervisors.cgroup_path(pid).endswith(f"/system.slice/{name}")
    assert supervisors.of(pid) == supervisors.Supervisor("systemd", name, "always")
    assert supervisors.of(os.getpid()) is None  # the test itself runs under no unit


def test_restart_always_brings_back_a_process_sigtermed_by_pid_and_only_the_managers_stop_ends_it(unit):
    name = unit("always")
    first = _main(name)
    os.kill(first, signal.SIGTERM)
    again = wait_until(lambda: (p := int(_show(name)["MainPID"])) not in (0, first) and p, timeout=10,
                       message="systemd to start the unit's process again")
    done = supervisors.stop(supervisors.Supervisor("systemd", name, "always"), [again])
    assert done == f"systemctl stop {name}"
    time.sleep(0.6)  # three RestartSec: long enough for a restart that should not come
    assert _show(name) == {"MainPID": "0", "ActiveState": "inactive", "NRestarts": "1"}


def test_restart_on_failure_leaves_a_process_sigtermed_by_pid_down_as_systemd_counts_it_clean(unit):
    name = unit("on-failure")
    first = _main(name)
    os.kill(first, signal.SIGTERM)
    wait_until(lambda: _show(name)["ActiveState"] == "inactive", timeout=10, message="the unit inactive")
    time.sleep(0.6)  # three RestartSec
    assert _show(name) == {"MainPID": "0", "ActiveState": "inactive", "NRestarts": "0"}
