"""Engines as containers of their own (deployments/host/containers.py), through the real `docker` SDK against
the Docker Engine API double (tests/dockerd.py): the container's main process is the engine, as the agent sees
it on the process path (its PID, its session, its user, its marker), and Docker's record of it says what the
panel asked for (host network and IPC, the mounts, GPUs as a device request, the marker as a label)."""
import os
import time
from pathlib import Path

import psutil
import pytest

from deployments.host import containers, osuser, ownership, processes
from tests import dockerd
from tests.conftest import wait_until

MARKER = "7.0123456789abcdef01234567"


@pytest.fixture
def docker_host(tmp_path, monkeypatch):
    with dockerd.running(tmp_path / "dockerd") as host:
        monkeypatch.setenv("DOCKER_HOST", host)
        monkeypatch.setenv(containers.RUNTIME_VAR, "docker")
        monkeypatch.setenv(containers.IMAGE_VAR, "vllm-panel-node:test")
        monkeypatch.setenv(containers.MOUNTS_VAR, f"/models:/models,panelvar:{tmp_path}")
        yield host


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
    assert recorded["AutoRemove"] is True
    assert recorded["Binds"] == ["/models:/models", f"panelvar:{tmp_path}"]
    assert recorded["SecurityOpt"] == ["no-new-privileges"]

    result = processes.stop(pid, term_timeout_s=5)
    assert result.signals_sent == ["SIGTERM"] and not result.survivors
    wait_until(lambda: containers.find(MARKER) == [], timeout=10, message="Docker to remove the exited container")


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
