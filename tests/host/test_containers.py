"""Engines as containers of their own (deployments/host/containers.py), through the real `docker` SDK against
the Docker Engine API double (tests/dockerd.py): the container's main process is the engine, as the agent sees
it on the process path (its PID, its session, its user, its marker), and Docker's record of it says what the
panel asked for (host network and IPC, the mounts, GPUs as a device request, the marker as a label)."""
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from deployments.host import containers, keepers, osuser, ownership, processes
from tests import dockerd
from tests.conftest import wait_until

MARKER = "7.0123456789abcdef01234567"


@pytest.fixture
def docker_daemon(tmp_path, monkeypatch):
    with dockerd.running(tmp_path / "dockerd", handle=True) as daemon:
        monkeypatch.setenv("DOCKER_HOST", daemon.host)
        monkeypatch.setenv(containers.RUNTIME_VAR, "docker")
        monkeypatch.setenv(containers.IMAGE_VAR, "vllm-panel-node:test")
        monkeypatch.setenv(containers.MOUNTS_VAR, f"/models:/models,panelvar:{tmp_path}")
        yield daemon


@pytest.fixture
def docker_host(docker_daemon):
    return docker_daemon.host


def _spec(tmp_path, **env) -> processes.EngineSpec:
    code = "import os, time; print('serving', os.getcwd(), flush=True); time.sleep(120)"
    model = tmp_path / "model"  # the engine's working folder, as a model's: readable by the engine user
    model.mkdir(mode=0o755, exist_ok=True)
    # /usr/bin/env first: a shebang's hop, one exec more, as the fake engine's script has
    return processes.EngineSpec(argv=["/usr/bin/env", "python3", "-c", code], env={ownership.MARKER_VAR: MARKER, **env},
                             log_path=tmp_path / "logs" / "engine.log", cwd=model, run_as=osuser.current())


def test_an_engine_container_is_the_engine_process_the_agent_follows_and_stops(docker_host, tmp_path):
    spec = _spec(tmp_path)
    handle = processes.launch(spec)
    pid = handle.pid
    proc = psutil.Process(pid)
    # Every exec is behind it when launch returns: mid-exec, the marker that proves it ours cannot be read.
    assert proc.cmdline()[1:3] == ["-c", spec.argv[3]], "the container's main process is the engine itself"
    assert handle.pgid == pid and handle.create_time == proc.create_time()
    wait_until(lambda: "serving" in spec.log_path.read_text() if spec.log_path.exists() else False, timeout=20,
               message="the engine's first log line")
    assert ownership.marker_of(pid) == MARKER and ownership.pid_owned(pid, MARKER)
    assert os.getsid(pid) == pid, "a session of its own: the agent stops the engine by its session"
    assert proc.uids().real == spec.run_as.uid, "it runs as the engine user, as on the process path"
    assert Path(proc.cwd()) == spec.cwd and f"serving {spec.cwd}" in spec.log_path.read_text()
    assert (spec.log_path.stat().st_mode & 0o777) == 0o600
    assert Path(f"/proc/{pid}/status").read_text().split("NoNewPrivs:")[1].split()[0] == "1"

    [found] = containers.find(MARKER)
    assert found["pid"] == pid and found["status"] == "running" and found["name"].startswith(f"vllm-panel-{MARKER}-")
    recorded = containers.client().containers.get(found["id"]).attrs["HostConfig"]
    assert (recorded["PidMode"], recorded["NetworkMode"], recorded["IpcMode"]) == ("host", "host", "host")
    assert not recorded.get("AutoRemove") and recorded["RestartPolicy"]["Name"] == "no", "kept until swept"
    assert recorded["Binds"] == ["/models:/models", f"panelvar:{tmp_path}"]
    assert recorded["SecurityOpt"] == ["no-new-privileges"]

    result = processes.stop(pid, term_timeout_s=5)
    assert result.signals_sent == ["SIGTERM"] and not result.survivors
    assert containers.sweep(MARKER, wait_s=5) == [found["name"]], "the exited container, not kept, is removed"
    assert containers.find(MARKER) == []


def test_two_launches_with_one_marker_both_start(docker_host, tmp_path):
    """A Ray deployment's head and the engine started on it carry the same marker (deployments/node/raycluster.py)."""
    pids = [processes.launch(_spec(tmp_path)).pid for _ in range(2)]
    assert sorted(c["pid"] for c in containers.find(MARKER)) == sorted(pids)
    for pid in pids:
        processes.stop(pid, term_timeout_s=5)


def test_the_deployments_gpus_are_a_device_request_numbered_from_zero_inside(docker_host, tmp_path):
    spec = _spec(tmp_path, CUDA_VISIBLE_DEVICES="2,5")
    config = containers.container_config(processes.popen_args(spec), spec.log_path)
    [request] = config["device_requests"]
    assert request["Driver"] == "nvidia" and request["DeviceIDs"] == ["2", "5"] and request["Capabilities"] == [["gpu"]]
    assert config["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1", "inside, only those two exist, as 0 and 1"
    assert containers.container_config(processes.popen_args(_spec(tmp_path)), spec.log_path)["device_requests"] == []
    pid = containers.start(processes.popen_args(spec), spec.log_path)
    [found] = containers.find(MARKER)
    recorded = containers.client().containers.get(found["id"]).attrs["HostConfig"]["DeviceRequests"]
    assert recorded[0]["DeviceIDs"] == ["2", "5"]
    processes.stop(pid, term_timeout_s=5)


def test_an_engine_that_cannot_start_says_so_in_its_log(docker_host, tmp_path):
    spec = processes.EngineSpec(argv=[str(tmp_path / "no-such-vllm")], env={ownership.MARKER_VAR: MARKER},
                             log_path=tmp_path / "logs" / "engine.log", cwd=tmp_path)
    try:
        pid = containers.start(processes.popen_args(spec), spec.log_path)
    except containers.ContainerError as exc:  # it exited before the inspect: that is said too
        assert exc.permanent
    else:
        wait_until(lambda: not processes.alive(pid), timeout=10, message="the failed engine to exit")
    wait_until(lambda: spec.log_path.exists() and "no-such-vllm: No such file" in spec.log_path.read_text(), timeout=10,
               message="the reason in the engine's log")


def test_settings_that_cannot_work_are_refused_for_good(monkeypatch, tmp_path):
    monkeypatch.setenv(containers.RUNTIME_VAR, "podman")
    with pytest.raises(processes.EngineError) as refused:
        processes.launch(_spec(tmp_path))
    assert refused.value.permanent and "process, docker" in str(refused.value)
    monkeypatch.setenv(containers.RUNTIME_VAR, "docker")
    monkeypatch.delenv(containers.IMAGE_VAR, raising=False)
    with pytest.raises(containers.ContainerError, match=containers.IMAGE_VAR):
        containers.container_config(processes.popen_args(_spec(tmp_path)), tmp_path / "log")
    for bad in ("/models", "models:relative", "a:/b:rx"):
        with pytest.raises(containers.ContainerError, match="source:/target"):
            containers.mounts(bad)


def test_a_daemon_that_is_away_is_worth_retrying(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    monkeypatch.setenv(containers.IMAGE_VAR, "vllm-panel-node:test")
    monkeypatch.setenv(containers.RUNTIME_VAR, "docker")
    started = time.monotonic()
    with pytest.raises(processes.EngineError) as away:  # what the lifecycle catches, whichever runtime launched
        processes.launch(_spec(tmp_path))
    assert not away.value.permanent and "Docker daemon" in str(away.value) and time.monotonic() - started < containers.API_TIMEOUT_S


def test_a_container_removed_between_the_list_and_its_inspect_is_not_an_error(monkeypatch):
    """Docker lists containers, then inspects each: one removed in between (another stop, another agent's run on the
    same daemon) made find() fail the whole listing with a 404."""
    import docker
    from unittest import mock

    api = mock.Mock()
    api.containers.return_value = [{"Id": "gone"}, {"Id": "here"}]

    def inspect(container_id):
        if container_id == "gone":
            raise docker.errors.NotFound("No such container: gone")
        return {"Id": "here", "Name": "/engine", "State": {"Status": "running", "Pid": 42},
                "Config": {"Labels": {containers.MARKER_LABEL: "m1"}}}

    api.inspect_container.side_effect = inspect
    daemon = docker.DockerClient.__new__(docker.DockerClient)
    daemon.api = api
    monkeypatch.setattr(containers, "client", lambda: daemon)
    assert containers.find() == [{"id": "here", "name": "engine", "status": "running", "pid": 42, "marker": "m1"}]


def test_a_kept_engine_container_comes_back_after_a_crash_and_a_boot_and_a_release_stops_it_for_good(docker_daemon,
                                                                                                   tmp_path):
    """A persist keeps the running engine's container (Docker's restart policy, no second start); Docker then starts
    it again when it crashes and when the host boots, and the keeper's status reads as a systemd unit's would. A
    release stops it through Docker, so neither an exit nor a boot brings it back."""
    pid = processes.launch(_spec(tmp_path)).pid
    name = containers.keep(MARKER)
    unit = keepers.of_container(name)
    status = keepers.status(unit)
    assert (status.main_pid, status.active, status.enabled, status.coming) == (pid, "active", "enabled", True)

    os.kill(pid, signal.SIGKILL)  # a crash: Docker starts the same container again, the same marker
    # The marker is read once the new process has exec'd with it: Docker reports its PID from the fork on.
    again = wait_until(lambda: (s := keepers.status(unit)).active == "active" and s.main_pid not in (0, pid)
                       and ownership.marker_of(s.main_pid) == MARKER and s,
                       timeout=20, message="Docker to start the crashed engine again, with its marker")
    assert again.restarts == 1
    assert containers.sweep() == [], "a kept container is never swept"

    docker_daemon.reboot()
    booted = wait_until(lambda: (s := keepers.status(unit)).active == "active" and s.main_pid
                        and ownership.marker_of(s.main_pid) == MARKER and s, timeout=20,
                        message="the kept engine to start with the daemon, with its marker")
    assert booted.main_pid != again.main_pid

    keepers.disable(unit, term_s=5)
    assert containers.find(MARKER) == [] and not processes.alive(booted.main_pid, 0.0)
    gone = keepers.status(unit)
    assert (gone.active, gone.enabled, gone.coming) == ("inactive", "not-found", False)
    docker_daemon.reboot()
    assert containers.find(MARKER) == [], "released: a boot brings nothing back"


def test_an_engine_container_is_kept_only_when_asked_and_docker_refuses_a_policy_on_an_autoremove_one(docker_host,
                                                                                                    tmp_path):
    """The double refuses what Docker refuses: a restart policy on a container Docker removes once it exits (why
    the panel's engine containers are not AutoRemove)."""
    spec = _spec(tmp_path)
    pid = containers.start(processes.popen_args(spec), spec.log_path, keep=True)
    [found] = containers.find(MARKER)
    assert containers.state(found["name"])["policy"] == containers.KEEP_POLICY and found["pid"] == pid
    containers.release(found["name"], timeout_s=5)
    assert containers.find(MARKER) == []
    with pytest.raises(containers.ContainerError, match="no running engine container"):
        containers.keep(MARKER)
    removed_on_exit = containers.client().containers.run("vllm-panel-node:test", ["sleep", "30"], detach=True,
                                                        auto_remove=True)
    import docker

    with pytest.raises(docker.errors.APIError, match="Restart policy cannot be updated because AutoRemove is enabled"):
        removed_on_exit.update(restart_policy={"Name": containers.KEEP_POLICY})
    removed_on_exit.remove(force=True)
