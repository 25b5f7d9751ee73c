"""The true-state checks themselves (tests/truestate.py) can fail: a fake engine started by hand in
a model folder is found with its child, a second engine in a ready row's folder, an engine of a
stopped row and a SIGKILLed engine's /dev/shm file are each caught, and a file with the real
engine's names is this test's only once it appears after the test began, stale only once the
test's engines are gone."""
import mmap
import os
import secrets
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest

from deployments.host import processes
from deployments.models import Deployment
from tests import truestate
from tests.conftest import free_port, wait_until
from tests.factories import DeploymentFactory
from tests.truestate import FAKE_VLLM, assert_true_state, engines_under, set_load, stale_shm, stop_leftover_engines

pytestmark = [pytest.mark.faults, pytest.mark.django_db]


def _fake_model(folder: Path) -> Path:
    folder.mkdir()
    set_load(folder, 0.1)
    return folder


def _start(argv, cwd, marker=None):
    env = {**os.environ, **({"PANEL_ENGINE": marker} if marker else {})}
    return subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)


def _fake_engine(folder: Path, marker: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    return _start([str(FAKE_VLLM), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port)], folder, marker), port


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _gone(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    os.killpg(proc.pid, sig)
    proc.wait(10)
    wait_until(lambda: not processes.members(proc.pid), timeout=10, message=f"engine group {proc.pid} to be gone")


def test_engines_under_finds_an_engine_and_its_child_and_assert_true_state_catches_each_wrong_state(tmp_path):
    folder, elsewhere = _fake_model(tmp_path / "model"), _fake_model(tmp_path / "other")
    marker = "1.0123456789abcdef01234567"
    api, port = _fake_engine(folder, marker)
    unmarked = _start(["sleep", "600"], folder)
    marked_elsewhere = _start(["sleep", "600"], elsewhere, marker="9.0123456789abcdef01234567")
    started = [api, unmarked, marked_elsewhere]
    try:
        found = wait_until(lambda: (f := {p.pid for p in engines_under(folder)}) and len(f) == 2 and f,
                           timeout=20, message="the fake engine and its EngineCore child")
        assert api.pid in found and unmarked.pid not in found and marked_elsewhere.pid not in found
        d = DeploymentFactory(status=Deployment.Status.READY, pid=api.pid, pgid=api.pid, marker=marker, port=port)
        wait_until(lambda: _answers(port), timeout=20, message="the fake engine's /health")
        assert_true_state(d, folder)  # the right state passes

        stray, _ = _fake_engine(folder, "2.0123456789abcdef01234567")
        started.append(stray)
        wait_until(lambda: len(engines_under(folder)) == 4, timeout=20, message="a second engine in the folder")
        with pytest.raises(AssertionError, match="outside its session"):
            assert_true_state(d, folder)
        _gone(stray)

        Deployment.objects.filter(pk=d.pk).update(status=Deployment.Status.STOPPED)
        with pytest.raises(AssertionError, match="stopped, but engine processes"):
            assert_true_state(d, folder)

        _gone(api, signal.SIGKILL)  # SIGKILL: the fake engine, like vLLM, leaves its /dev/shm file
        left = stale_shm()
        assert [Path(p).name.split("_")[2] for p in left] == [str(api.pid)], left
        with pytest.raises(AssertionError, match="stale /dev/shm files"):
            assert_true_state(d, folder)
        stop_leftover_engines(tmp_path)
        assert stale_shm() == [] and not any(Path(p).exists() for p in left)
    finally:
        for proc in started:
            processes.stop(proc.pid, term_timeout_s=2, kill_timeout_s=2)  # its /dev/shm file too
            proc.wait(10)


def _shm(name: str) -> Path:
    path = truestate.SHM / name
    path.write_bytes(b"\0" * 4096)
    return path


def test_files_with_the_real_engines_names_count_once_they_appear_and_only_unheld():
    before = _shm(f"psm_{secrets.token_hex(4)}")
    truestate.WATCH = truestate.ShmWatch(real_names=True)  # tests/faults' fixture restores its own after the test
    after, held = _shm(f"psm_{secrets.token_hex(4)}"), _shm(f"psm_{secrets.token_hex(4)}")
    semaphore, unrelated = _shm(f"sem.mp-{secrets.token_hex(4)}"), _shm(f"other_{secrets.token_hex(4)}")
    engine_like = subprocess.Popen(["sleep", "600"])
    truestate.WATCH.pids.add(engine_like.pid)  # as if seen: while an engine of the test runs, they are not stale yet
    try:
        # Only this test's files: a real engine of another test may add files with the same names meanwhile.
        mine = {str(p) for p in (before, after, held, semaphore, unrelated)}
        assert [f for f in stale_shm() if f in mine] == []
        engine_like.kill()
        engine_like.wait()
        with open(held, "r+b") as f, mmap.mmap(f.fileno(), 0):
            assert [f for f in stale_shm() if f in mine] == sorted([str(after), str(semaphore)])
        assert [f for f in stale_shm() if f in mine] == sorted([str(after), str(held), str(semaphore)])
    finally:
        if engine_like.poll() is None:
            engine_like.kill()
            engine_like.wait()
        for path in (before, after, held, semaphore, unrelated):
            path.unlink(missing_ok=True)


def test_the_fake_engine_stopped_as_soon_as_its_shared_file_exists_leaves_none(tmp_path):
    """A SIGTERM that comes while the fake starts its EngineCore stand-in still unlinks the file, as it does later:
    otherwise a test that stops a fake engine early (the stray above) finds a "stale" file it did not cause."""
    folder = _fake_model(tmp_path / "model")
    fake, _ = _fake_engine(folder, "3.0123456789abcdef01234567")
    shm = Path("/dev/shm")
    try:
        wait_until(lambda: list(shm.glob(f"psm_fakevllm_{fake.pid}_*")), timeout=20, interval=0.001,
                   message="the fake engine's shared file")
        os.killpg(fake.pid, signal.SIGTERM)
        fake.wait(10)
        assert not list(shm.glob(f"psm_fakevllm_{fake.pid}_*"))
    finally:
        stop_leftover_engines(tmp_path)


def test_a_file_an_earlier_fake_left_under_a_pid_that_came_round_again_is_not_the_new_engines():
    """CI saw 'stale /dev/shm files: [psm_fakevllm_19038_…]' for a live, serving fake engine of PID 19038: the file
    was an earlier process's (a SIGKILLed fake leaves its file), its PID reused at pid_max 32768. A file made before
    the process now holding the PID started is not that process's; one it made is."""
    holder = subprocess.Popen(["sleep", "60"])
    old = truestate.SHM / f"psm_fakevllm_{holder.pid}_{secrets.token_hex(4)}"
    new = truestate.SHM / f"psm_fakevllm_{holder.pid}_{secrets.token_hex(4)}"
    try:
        old.write_bytes(b"\0")
        started = psutil.Process(holder.pid).create_time()
        os.utime(old, (started - 60, started - 60))  # left a minute before this process began
        new.write_bytes(b"\0")
        watch = truestate.ShmWatch()
        watch.pids.add(holder.pid)
        assert watch.ours(rows=False) == {str(new)}
    finally:
        holder.kill()
        holder.wait()
        old.unlink(missing_ok=True)
        new.unlink(missing_ok=True)
