"""Persistence and reboots against a real systemd: a booted Debian container (tests/bootedsystemd.py, systemd 252 as
its PID 1) instead of the systemctl double the other reboot tests use (tests/faults/test_reboot.py).

- Every unit the panel writes passes the real `systemd-analyze verify`: vllm-panel.service (panelctl/service.py) and
  the engine unit the real agent wrote for a persisted deployment.
- What render_unit escapes in an engine unit (%, $, quotes, backslashes, spaces; the secrets' EnvironmentFile) reaches
  the engine's process word for word, as its User=.
- The real node agent runs inside the container as a unit of its own (its systemctl is the real one; it reaches the
  tests' Redis and database over the shared network, a SQLite file through the bound checkout). A deployment it
  persisted runs, after a real reboot of the container (`systemctl poweroff`, boot), under its unit, started by
  systemd at boot: KillMode=control-group, User= the engine user, the engine and its child in the unit's control
  group, the unit's MainPID the row's PID, carrying the deployment's marker, adopted by the agent (which came back as
  its unit too), and no other engine process. A crash of it: systemd starts it again (NRestarts 1), the agent adopts
  that one. Its stop goes through systemctl (systemd's journal has the stop job).
The engine is a double that holds the GPU log corpus (tests/faults/systemd/corpus_vllm.py): the recorded TP=8 GPU
load replayed into the unit's log at each start, then the fake engine (tests/faults/fakevllm)."""

import json
import shutil
from pathlib import Path

import psutil
import pytest
from django.utils import timezone

from deployments.host import ownership, systemd
from deployments.host.osuser import EngineUser
from deployments.models import Deployment, DeploymentEvent, Node
from deployments.services import deploys
from panelctl import service
from tests import bootedsystemd, gpucorpus
from tests.conftest import ROOT, wait_until
from tests.truestate import add_fake_model, agent_env, deploy, settle

pytestmark = [
    pytest.mark.faults,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(300),
]
AGENT_UNIT = "panel-test-agent.service"
ENGINE_DIR = "/opt/corpus-engine"  # in the container's own root: the engine user reaches it, nothing else of the host
FAKE = ROOT / "tests" / "faults" / "fakevllm"
CORPUS = gpucorpus.path("safetensors")
REPLAY_SPEED = 1000.0  # the recorded load, ~35 minutes on 8 GPUs, in about two seconds


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    """One booted container for the module (a boot is about a second); powered off and deleted after it."""
    if why := bootedsystemd.missing():  # never a silent skip
        pytest.fail(f"{why}: ./panel test installs what these tests need")
    from django.conf import settings

    # The tests' temporary folders (models, logs) and the session's key for sealed secrets (controlpanel/pytest_env.py).
    binds = bootedsystemd.panel_binds(
        tmp_path_factory.getbasetemp(), Path(settings.HF_TOKEN_KEY_FILE).parent
    )
    booted = bootedsystemd.Booted(bootedsystemd.root_fs(), binds)
    try:
        booted.boot()
        _install_engine(booted)
        yield booted
    finally:
        booted.close()


def _install_engine(box):
    """The corpus double as `vllm` in the container's /opt, the fake and the replayer beside it, readable by all."""
    folder = box.path(ENGINE_DIR)
    folder.mkdir(mode=0o755, parents=True)
    (folder / "vllm").write_text(
        "#!/usr/bin/python3\n"
        + (ROOT / "tests/faults/systemd/corpus_vllm.py").read_text()
    )
    shutil.copy(FAKE / "vllm", folder / "fakevllm")
    for extra in ("fakeproto.py", "serve-flags.txt"):
        shutil.copy(FAKE / extra, folder / extra)
    shutil.copy(ROOT / "tests" / "gpucorpus.py", folder / "gpucorpus.py")
    shutil.copy(CORPUS, folder / CORPUS.name)
    for path in folder.iterdir():
        path.chmod(0o755 if path.name == "vllm" else 0o644)


def _verify(box, unit: str):
    """The real `systemd-analyze verify` of a unit installed in the container: no error, and nothing said about it."""
    out = box.run(
        "systemd-analyze", "verify", f"/etc/systemd/system/{unit}", check=False
    )
    said = [line for line in (out.stdout + out.stderr).splitlines() if unit in line]
    assert out.returncode == 0 and not said, (out.returncode, out.stdout, out.stderr)


def test_the_panel_service_unit_passes_the_real_systemd_analyze_verify(box):
    text = service.unit_text(["--port", "8100", "--node-name", "gpu 01% $HOME"], ROOT)
    box.path(f"/etc/systemd/system/{service.UNIT}").write_text(text)
    try:
        _verify(box, service.UNIT)
    finally:
        box.path(f"/etc/systemd/system/{service.UNIT}").unlink()


ECHO = "import json, os, sys; json.dump({'argv': sys.argv[1:], 'env': dict(os.environ), 'uid': os.getuid()}, sys.stdout)"


def test_an_engine_unit_runs_its_words_and_environment_as_given_under_the_real_systemd(
    box,
):
    """What render_unit escapes (%, $, quotes, backslashes, spaces) reaches the process as it was given, the secret
    variables from the EnvironmentFile too, as the engine user."""
    name = "vllm-echo-test.service"
    words = [
        "100%",
        "$HOME",
        "${X}",
        'a "quoted" word',
        "back\\slash",
        "two  spaces",
        "%n",
        "'single'",
    ]
    env = {"PLAIN": "x", "ODD": '100% $HOME "q" \\b %n', "SPACE": "a b"}
    secret = {"VLLM_API_KEY": 'k$%"\\ y'}
    box.run("useradd", "--system", "--user-group", "--no-create-home", "echo-engine")
    uid, gid = (int(box.run("id", flag, "echo-engine").stdout) for flag in ("-u", "-g"))
    user = EngineUser(name="echo-engine", uid=uid, gid=gid, home="/nonexistent")
    text = systemd.render_unit(
        description="echo 100% $HOME",
        argv=["/usr/bin/python3", "-c", ECHO, *words],
        env=env,
        log_path="/var/tmp/echo.json",
        run_as=user,
        secret_env_file=f"/etc/systemd/system/{name}.env",
    )
    box.path(f"/etc/systemd/system/{name}").write_text(text)
    box.path(f"/etc/systemd/system/{name}.env").write_text(
        systemd.env_file_text(secret)
    )
    try:
        box.systemctl("daemon-reload")
        _verify(box, name)
        box.systemctl("start", name)
        wait_until(
            lambda: (
                box.show(name, "ActiveState")["ActiveState"] in ("inactive", "failed")
            ),
            timeout=30,
            message="the echo to end",
        )
        assert box.show(name, "Result")["Result"] == "success"
        seen = json.loads(box.run("cat", "/var/tmp/echo.json").stdout)
        assert seen["argv"] == words and seen["uid"] == uid
        assert {k: seen["env"].get(k) for k in (*env, *secret)} == {**env, **secret}
    finally:
        box.run("userdel", "echo-engine", check=False)
        box.run(
            "rm",
            "-f",
            f"/etc/systemd/system/{name}",
            f"/etc/systemd/system/{name}.env",
            "/var/tmp/echo.json",
        )
        box.systemctl("daemon-reload")


@pytest.fixture
def inside_agent(box, process_env, tmp_path, unique):
    """The real node agent as a unit of the container (enabled: a boot brings it back), the corpus double its vllm."""
    name = f"sysd-{unique}"
    env = agent_env(
        process_env,
        tmp_path,
        VLLM_BIN=f"{ENGINE_DIR}/vllm",
        ENGINE_UNIT_RESTART_SEC="1",
        PYTHONPATH=str(ROOT),
        PATH=f"{ROOT / '.venv' / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:"
        "/usr/bin:/sbin:/bin",
    )
    for var in (
        "SYSTEMD_UNIT_PATH",
        "SYSTEMCTL_DOUBLE_STATE",
    ):  # the real systemd's own places
        env.pop(var, None)
    env = {k: v for k, v in env.items() if not any(c in v for c in "\n\r\0")}
    box.path(f"/etc/{AGENT_UNIT}.env").write_text(systemd.env_file_text(env))
    argv = [
        str(ROOT / ".venv" / "bin" / "python"),
        "manage.py",
        "nodeagent",
        "--name",
        name,
        "--model-store",
        str(tmp_path / "store"),
        "--sample-seconds",
        "0.5",
        "--heartbeat-seconds",
        "1",
    ]
    box.path(f"/etc/systemd/system/{AGENT_UNIT}").write_text(
        "\n".join(
            [
                "[Unit]",
                "Description=the panel's node agent (test)",
                "",
                "[Service]",
                f"WorkingDirectory={ROOT}",
                f"EnvironmentFile=/etc/{AGENT_UNIT}.env",
                "ExecStart=" + " ".join(argv),
                f"StandardOutput=append:{tmp_path}/agent.log",
                f"StandardError=append:{tmp_path}/agent.log",
                "KillMode=process",
                "",
                "[Install]",
                "WantedBy=multi-user.target",
                "",
            ]
        )
    )
    box.systemctl("daemon-reload")
    box.systemctl("enable", "--now", AGENT_UNIT)
    yield name
    # SIGKILL, as tests/conftest.py's spawn does (a Celery worker's warm shutdown waits); then nothing of the test's
    # runs on: its engine units stopped and disabled.
    box.run("systemctl", "kill", "--signal=SIGKILL", AGENT_UNIT, check=False)
    box.run("systemctl", "disable", "--now", AGENT_UNIT, check=False)
    for unit in box.path("/etc/systemd/system").glob("vllm-*.service"):
        box.run("systemctl", "disable", "--now", unit.name, check=False)


def _agent_node(box, name):
    """The agent's node once the agent that runs now (the unit's MainPID) registered it."""
    pid = wait_until(
        lambda: int(box.show(AGENT_UNIT, "MainPID")["MainPID"]),
        timeout=60,
        message="the agent's unit",
    )
    return wait_until(
        lambda: Node.objects.filter(name=name, agent_pid=pid).first(),
        timeout=90,
        message=f"the agent in the container (PID {pid}) to register",
    )


def _host_pid(box, ns_pid):
    return next((p.pid for p in box.processes() if box.ns_pid(p.pid) == ns_pid), 0)


def _engine_processes(box):
    """The container's processes of the engine double (its server and its core child), as the host numbers them."""
    found = []
    for proc in box.processes():
        try:
            if any(a.startswith(ENGINE_DIR) for a in proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def _under_its_unit(box, row):
    """The unit's engine as the real systemd sees it, and the processes of the double all in its control group."""
    unit = box.show(
        row.systemd_unit,
        "MainPID",
        "ControlGroup",
        "KillMode",
        "User",
        "ActiveState",
        "UnitFileState",
    )
    engine_uid = box.run("id", "-u", unit["User"]).stdout.strip()
    assert unit["KillMode"] == "control-group" and unit["User"] == "vllm-engine", unit
    assert (unit["ActiveState"], unit["UnitFileState"]) == ("active", "enabled"), unit
    assert int(unit["MainPID"]) == row.pid, (unit, row.pid)
    host = _host_pid(box, row.pid)
    assert ownership.marker_of(host) == row.marker and ownership.engines_marked(
        row.marker
    ) == [host]
    doubles = _engine_processes(box)
    # The server and its EngineCore, nothing else.
    assert host in doubles and len(doubles) == 2, doubles
    for pid in doubles:
        inside = box.ns_pid(pid)
        cgroups = box.run("cat", f"/proc/{inside}/cgroup").stdout.splitlines()
        assert any(line.endswith(":" + unit["ControlGroup"]) for line in cgroups), (
            pid,
            cgroups,
            unit,
        )
        assert (
            box.run("stat", "-c", "%u", f"/proc/{inside}").stdout.strip() == engine_uid
        )
    return unit


def _adopted_since(d, since):
    """The deployment ready again, its engine adopted since `since` (proven by its marker), its load followed."""
    wait_until(
        lambda: (
            DeploymentEvent.objects.filter(
                deployment=d, step="adopted", started__gte=since
            ).exists()
            or Deployment.objects.get(pk=d.pk).status in ("failed", "stopped")
        ),
        timeout=90,
        message="the adoption",
    )
    row = settle(d, timeout=90)
    assert row.status == "ready", row.status_message
    adopted = DeploymentEvent.objects.filter(deployment=d, step="adopted").last()
    assert "proven by its marker" in adopted.message, adopted.message
    return row


@pytest.mark.slow
def test_a_persisted_deployment_comes_back_under_the_real_systemd_after_a_reboot_and_a_crash(
    box, inside_agent, fake_model
):
    """Slow (30 s alone, past 60 s beside a loaded run): a deploy, a persist, a real reboot (the agent's Django start
    inside is most of it), a crash that systemd restarts after RestartSec, and a stop, each waited for as it happens."""
    node = _agent_node(box, inside_agent)
    wait_until(
        lambda: Node.objects.get(pk=node.pk).systemd,
        timeout=30,
        message="the node to report systemd",
    )
    (fake_model / "fake_engine.json").write_text(
        json.dumps(
            {
                "load_s": 1.0,
                "stop_s": 0.0,
                "replay": f"{ENGINE_DIR}/{CORPUS.name}",
                "replay_speed": REPLAY_SPEED,
            }
        )
    )
    model = add_fake_model(node, fake_model)
    d = deploy(model, node)
    assert settle(d, timeout=90).status == "ready", Deployment.objects.get(
        pk=d.pk
    ).status_message
    serving = Deployment.objects.get(pk=d.pk).pid
    deploys.deployment_persist(Deployment.objects.get(pk=d.pk))
    wait_until(
        lambda: DeploymentEvent.objects.filter(
            deployment=d, step="persist", message__startswith="Installed"
        ).exists(),
        timeout=60,
        message="the unit installed",
    )
    row = Deployment.objects.get(pk=d.pk)
    # The engine that served serves on; the unit is for the next boot.
    assert row.status == "ready" and row.pid == serving
    assert box.show(row.systemd_unit, "UnitFileState", "ActiveState") == {
        "UnitFileState": "enabled",
        "ActiveState": "inactive",
    }
    _verify(box, row.systemd_unit)

    since = timezone.now()
    # systemctl poweroff in the container, and a boot: the agent and the engine come back as units.
    box.reboot()
    _agent_node(box, inside_agent)
    row = _adopted_since(d, since)
    _under_its_unit(box, row)
    # systemd started it at boot: the agent found it running and had no unit to start itself.
    assert not DeploymentEvent.objects.filter(
        deployment=d, step="unit_start", started__gte=since
    ).exists()
    # The unit's engine is the corpus double: the recorded GPU load is in its log, from this boot's start too.
    log = Path(row.log_path).read_text()
    last = gpucorpus.read(CORPUS)[-1][1]
    assert log.count(last) >= 2, (
        "the GPU corpus's load in the engine log, at the deploy and at the boot"
    )

    # A crash of the unit's engine: systemd starts it again (Restart=on-failure; KillMode=control-group ended its
    # child with it), the agent adopts that one and restarts nothing itself.
    since = timezone.now()
    psutil.Process(_host_pid(box, row.pid)).kill()
    again = _adopted_since(d, since)
    assert again.pid != row.pid and again.restarts == 0 and again.marker == row.marker
    assert box.show(row.systemd_unit, "NRestarts")["NRestarts"] == "1"
    assert not DeploymentEvent.objects.filter(
        deployment=d, step="unit_start", started__gte=since
    ).exists()
    row = again
    _under_its_unit(box, row)

    deploys.deployment_stop(row)
    stopped = settle(d, timeout=60, states={"stopped", "failed"})
    assert stopped.status == "stopped", stopped.status_message
    unit = box.show(row.systemd_unit, "ActiveState", "UnitFileState", "Result")
    assert unit == {
        "ActiveState": "inactive",
        "UnitFileState": "disabled",
        "Result": "success",
    }, unit
    # A stop job of systemd's, not a signal to the PID (then systemd would have seen its main process exit first):
    # after the unit's last start, its journal says "Stopping", then stopped.
    journal = box.run(
        "journalctl", "-b", "-u", row.systemd_unit, "--no-pager", "-o", "cat"
    ).stdout.splitlines()
    last = max(i for i, line in enumerate(journal) if line.startswith("Started "))
    after = journal[last + 1 :]
    steps = [
        line.split(" ", 1)[0] for line in after if not line.startswith(row.systemd_unit)
    ]
    assert steps == ["Stopping", "Stopped"], journal
    assert not any("Main process exited" in line for line in after), journal
    assert _engine_processes(box) == []
