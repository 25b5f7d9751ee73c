"""Unit tests of deployments.host.processes: processes launched, stopped and cleaned up (no vLLM, no database)."""
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from deployments.host import processenv, processes, processlog
from deployments.host.processes import EngineError, EngineSpec

# --- processes --------------------------------------------------------------------------------

# A leader and children that ignore SIGTERM; one child leaves the process group (not the
# session), one holds Python SharedMemory (registered with a resource tracker), one maps an
# untracked /dev/shm file.
TREE = """
import mmap, os, signal, subprocess, sys, time
from multiprocessing import shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
role, pids, raw = sys.argv[1], sys.argv[2], sys.argv[3]
def spawn(r):
    return subprocess.Popen([sys.executable, __file__, r, pids, raw]).pid
if role == "leader":
    spawn("child"); spawn("escaper")
elif role == "child":
    spawn("grandchild")
    shm = shared_memory.SharedMemory(create=True, size=4096)
    with open(pids + ".psm", "w") as f: f.write(shm.name)
elif role == "escaper":
    os.setpgid(0, 0)
    fd = os.open(raw, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096); os.close(fd)
with open(pids, "a") as f: f.write(f"{os.getpid()}\\n")
while True: time.sleep(1)
"""


@pytest.fixture
def launch_tree(tmp_path):
    """Start TREE; whatever a failing test leaves is stopped and unlinked afterwards."""
    raw, handles = f"/dev/shm/enginetest_{uuid.uuid4().hex}", []
    yield lambda ignore_term=True: _launch_tree(tmp_path, raw, handles, ignore_term)
    for handle in handles:
        processes.stop(handle.pgid, term_timeout_s=0.1)
    Path(raw).unlink(missing_ok=True)


def _launch_tree(tmp_path, raw, handles, ignore_term):
    pids = tmp_path / "pids"
    code = TREE if ignore_term else TREE.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN)", "")
    script = tmp_path / "tree.py"
    script.write_text(code)
    argv = [sys.executable, str(script), "leader", str(pids), raw]
    handle = processes.launch(EngineSpec(argv, {"ENGINE_TEST": "1"}, tmp_path / "tree.log"))
    handles.append(handle)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if pids.exists() and len(pids.read_text().split()) == 4 and Path(raw).exists():
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"tree did not start: {processlog.tail(tmp_path / 'tree.log')}")
    psm = "/dev/shm/" + (tmp_path / "pids.psm").read_text().lstrip("/")
    return handle, [int(p) for p in pids.read_text().split()], psm, raw


def test_stop_escalates_to_sigkill_and_leaves_no_process_or_shm_file(launch_tree):
    handle, pids, psm, raw = launch_tree()
    assert processes.alive(handle.pid, handle.create_time)
    assert os.getpgid(handle.pid) == handle.pgid == handle.pid
    assert psutil.Process(handle.pid).environ()["ENGINE_TEST"] == "1"
    assert set(pids) <= set(processes.members(handle.pgid))
    assert {psm, raw} <= processes.shm_files(handle.pgid)

    term_s, kill_s = 1.0, 10.0
    result = processes.stop(handle.pgid, term_timeout_s=term_s, kill_timeout_s=kill_s)

    assert result.signals_sent == ["SIGTERM", "SIGKILL"]
    assert result.survivors == [] and processes.members(handle.pgid) == []
    # Relations to its own deadlines: KILL only after TERM's deadline, and done before KILL's ran out.
    assert term_s <= result.seconds < term_s + kill_s
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    assert not processes.alive(handle.pid, handle.create_time)
    # The resource tracker unlinks the SharedMemory; stop() removes the untracked file.
    assert not Path(psm).exists() and not Path(raw).exists()
    assert raw in result.shm_removed


def test_stop_of_a_group_that_obeys_sigterm_sends_nothing_more(launch_tree):
    handle, pids, psm, raw = launch_tree(ignore_term=False)
    term_s = 10.0
    result = processes.stop(handle.pgid, term_timeout_s=term_s)
    assert result.signals_sent == ["SIGTERM"] and result.survivors == []
    assert result.seconds < term_s  # it returned when the group ended, not at the deadline
    assert not Path(raw).exists()
    assert processes.stop(handle.pgid).signals_sent == []


def test_stop_refuses_to_signal_its_own_process_group():
    with pytest.raises(EngineError):
        processes.stop(os.getpgrp())


def test_launch_of_a_missing_binary_is_a_permanent_error(tmp_path):
    with pytest.raises(EngineError) as err:
        processes.launch(EngineSpec([str(tmp_path / "no-vllm")], {}, tmp_path / "x.log"))
    assert err.value.permanent


def test_port_free_sees_a_listening_socket():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not processes.port_free("127.0.0.1", port)
        assert not processes.port_free("0.0.0.0", port)
    assert processes.port_free("127.0.0.1", port)



# --- environment ------------------------------------------------------------------------------


def test_a_deployments_env_is_the_offline_defaults_then_its_own_variables_then_its_gpus():
    env = processenv.deployment_env({"NCCL_PROTO": "LL", "VLLM_NO_USAGE_STATS": "0", "CUDA_VISIBLE_DEVICES": "7"}, [2, 3])
    assert env["HF_HUB_OFFLINE"] == "1" and env["NCCL_PROTO"] == "LL"
    assert env["VLLM_NO_USAGE_STATS"] == "0"  # the deployment's own wins over the panel's default
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the GPUs it was given win over a typed value
    assert "CUDA_VISIBLE_DEVICES" not in processenv.deployment_env({}, [])


def test_a_live_semaphore_is_held_though_its_creator_maps_it_under_another_name():
    """glibc's sem_open makes a semaphore under a temporary name, maps it, links the real name and unlinks the
    temporary one: its creator's /proc/<pid>/maps reads `/dev/shm/sem.XXXXXX (deleted)`, never `sem.mp-…`. Held
    by path alone, a live Python semaphore looked unused and was removed, and the spawned child that was about to
    open it died (`SemLock._rebuild`: FileNotFoundError; a benchmark worker beside a fault test did). Held is by
    the file itself (its inode)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    path = f"/dev/shm/sem.{lock._semlock.name.lstrip('/')}"
    assert Path(path).exists() and path not in processes._shm_paths_of(os.getpid())  # invisible by its name
    assert processes.remove_unused_shm({path}) == [] and Path(path).exists()
    child = ctx.Process(target=_take, args=(lock,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    del lock  # its creator lets go: now it is unused, and removed (Python's finalizer would have unlinked it)
    import gc

    gc.collect()
    left = Path(path)
    assert not left.exists() or processes.remove_unused_shm({path}) == [path]


def _take(lock) -> None:
    with lock:
        pass


def test_a_process_stays_alive_when_the_wall_clock_is_stepped_and_another_start_on_its_pid_is_not_it(monkeypatch):
    """A start read as wall-clock time is the kernel's boot time plus the ticks since: /proc/stat's btime moves by
    whole seconds when the clock is stepped (a fraction of a second near its boundary moves it one), and a loading
    engine judged gone then fails its deploy. Another process on the same PID started minutes apart."""
    import psutil._pslinux as pslinux

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorded = psutil.Process(proc.pid).create_time()
        booted = pslinux.boot_time()
        monkeypatch.setattr(pslinux, "boot_time", lambda: booted + 1.0)  # the clock stepped a second forward
        assert psutil.Process(proc.pid).create_time() != recorded  # what the running engine now reads
        assert processes.alive(proc.pid, recorded)
        assert not processes.alive(proc.pid, recorded - 120)  # a process on this PID two minutes earlier
    finally:
        proc.kill()
        proc.wait()
