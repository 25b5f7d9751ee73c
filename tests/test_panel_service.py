"""`./panel service`: the panel as a systemd unit that a boot brings back (panelctl/service.py). The unit's command is
`<checkout>/panel start` with the options given, read by systemd's own word rules; installed through the systemctl
double (tests/faults/systemd: the real command line, real processes), here with a stand-in checkout whose `panel`
records how it was started, so no second panel runs beside the tests."""
import json
import os
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from deployments.host import systemd
from panelctl import launcher, service
from tests.conftest import ROOT, wait_until

DOUBLE = ROOT / "tests" / "faults" / "systemd"


def _settings(text: str) -> dict:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_the_unit_runs_panel_start_with_the_options_given_in_the_checkout_and_leaves_engines_to_the_agent():
    text = service.unit_text(["--port", "8100", "--node-name", "gpu 01%"], Path("/srv/panel"))
    unit = _settings(text)
    words = [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(unit["ExecStart"])]
    assert words == ["/srv/panel/panel", "start", "--port", "8100", "--node-name", "gpu 01%"]
    assert unit["WorkingDirectory"] == "/srv/panel" and unit["EnvironmentFile"] == "-/srv/panel/.env"
    # A stop signals the launcher alone: it stops its own children, the engines keep serving (as after Ctrl-C).
    assert (unit["KillMode"], unit["Restart"], unit["WantedBy"]) == ("process", "always", "multi-user.target")


def test_options_start_would_refuse_are_refused_before_a_unit_is_written(capsys):
    with pytest.raises(SystemExit):
        launcher.main(["service", "show", "--port", "not-a-port"])
    assert "invalid int value" in capsys.readouterr().err


@pytest.fixture
def double(tmp_path, monkeypatch):
    units = tmp_path / "units"
    units.mkdir()
    monkeypatch.setenv("PATH", f"{DOUBLE}:{os.environ['PATH']}")
    monkeypatch.setenv("SYSTEMCTL_DOUBLE_STATE", str(tmp_path / "state"))
    env = {**os.environ, "SYSTEMD_UNIT_PATH": str(units)}
    monkeypatch.setenv("SYSTEMD_UNIT_PATH", str(units))
    yield env
    subprocess.run(["systemctl", "stop", service.UNIT], env=env, timeout=60, check=False)


def test_install_enables_and_starts_the_panel_a_boot_brings_it_back_and_remove_undoes_it(tmp_path, double):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    started = tmp_path / "started"
    (checkout / "panel").write_text(f"#!/bin/sh\necho \"$PWD $PANEL_TEST_VAR $*\" >> {started}\nexec sleep 600\n")
    (checkout / "panel").chmod(0o755)
    (checkout / ".env").write_text("PANEL_TEST_VAR=from-dotenv\n")
    print(service.install(["--port", "8100"], checkout))
    assert (service.unit_dir() / service.UNIT).exists()
    wait_until(lambda: started.exists() and started.read_text().splitlines(), timeout=15, message="the panel started")
    assert started.read_text().splitlines() == [f"{checkout} from-dotenv start --port 8100"]
    show = dict(line.split("=", 1) for line in systemd.systemctl("show", "-p", "MainPID,UnitFileState",
                                                                  service.UNIT).split())
    assert show["UnitFileState"] == "enabled"
    # The machine goes down (everything killed) and boots: the enabled unit starts the panel again.
    state = Path(double["SYSTEMCTL_DOUBLE_STATE"])
    supervisor = json.loads((state / f"{service.UNIT}.json").read_text())["supervisor"]
    for pid in (int(show["MainPID"]), supervisor):
        os.kill(pid, signal.SIGKILL)
    subprocess.run(["systemctl", "__boot"], env=double, check=True, timeout=30)
    wait_until(lambda: len(started.read_text().splitlines()) == 2, timeout=15, message="the panel back after the boot")
    print(service.remove())
    assert not (service.unit_dir() / service.UNIT).exists()
    assert subprocess.run(["systemctl", "is-enabled", service.UNIT], env=double, capture_output=True,
                          timeout=30).returncode != 0
