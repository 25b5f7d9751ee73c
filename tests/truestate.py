"""Real node agents (killed with SIGKILL and started again) running tests/faults' fake vLLM or the
real one, and checks of the true state they leave: what the API says is what runs, no engine
process that nobody owns, no /dev/shm file that an engine of this test left behind. Used by the
fault suite (tests/faults/) and the real-engine kill (tests/e2e/test_engine_kill.py).

Every kill is counted in COUNTS; the fault suite prints the totals at its end. Random moments come from the
running test's own RNG (tests/faults/replay.py: FAULT_SEED replays them)."""
import collections
import json
import os
import re
import signal
from pathlib import Path

import psutil

from tests.conftest import ROOT, agent_argv, free_port, wait_until
from tests.faults import replay

FAKE_VLLM = ROOT / "tests" / "faults" / "fakevllm" / "vllm"
COUNTS: collections.Counter = collections.Counter()
SETTLED = {"ready", "failed", "stopped"}
SHM = Path("/dev/shm")
# The fake engine's files name its API server's PID: psm_fakevllm_<pid>_<hex>.
FAKE_SHM = re.compile(r"psm_fakevllm_(\d+)_[0-9a-f]+")
# The real CPU vLLM 0.32's files, seen by listing /dev/shm while it loaded and served on the tiny
# model: Python's multiprocessing.shared_memory segments, psm_ and 8 hex digits (shm_broadcast's
# MessageQueue rings, mapped by EngineCore and its Worker), and multiprocessing's named semaphores,
# sem.mp-<8 characters> (a SIGKILLed group leaves both; Python's resource tracker unlinks them when
# its clients end); with tensor parallelism also its CPU communicator's <port>-tp:<rank>-[<ranks>]-cpushm_<n>
# (vllm/distributed/device_communicators/cpu_communicator.py; seen from a TP=2 engine on this host).
REAL_SHM = re.compile(r"psm_[0-9a-f]{8}|sem\.mp-[0-9a-z_]{8}|.+-cpushm_\d+")


class Agent:
    """A real `manage.py nodeagent` process; kill() is a SIGKILL. `script` replaces manage.py."""

    def __init__(self, spawn, env, name, store, script="manage.py"):
        self.spawn, self.env, self.name, self.store, self.script = spawn, env, name, store, script
        self.proc = None
        self.node = None

    def start(self, timeout=90):
        from deployments.models import Node

        argv = agent_argv(self.name, self.store, sample_seconds=0.5, heartbeat_seconds=1)
        argv[1] = str(self.script)
        self.proc = self.spawn(argv, self.env, name=self.name)
        pid = self.proc.pid
        self.node = wait_until(lambda: Node.objects.filter(name=self.name, agent_pid=pid).first(), timeout=timeout,
                               message=f"agent {self.name} (PID {pid}) to register")
        return self.node

    def kill(self):
        """SIGKILL the agent (its engines run in their own sessions and live on, as on a real host)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        COUNTS["agent_sigkills"] += 1

    def restart(self):
        self.kill()
        return self.start()


def random_moment(low, high) -> float:
    """When to inject a fault: at random, so that repeated runs land everywhere inside the window; from the running
    test's own RNG, so that FAULT_SEED replays it whichever worker runs the test (tests/faults/replay.py)."""
    return replay.moment(low, high)


def set_load(folder: Path, load_s: float, stop_s: float = 0.0, hold: Path | None = None) -> None:
    """How long the fake engine takes from start to /health, and to exit after a SIGTERM once it serves; with `hold`,
    its load also lasts as long as that file exists."""
    config = {"load_s": load_s, "stop_s": stop_s} | ({"hold": str(hold)} if hold else {})
    (folder / "fake_engine.json").write_text(json.dumps(config))


def agent_env(process_env, tmp_path, **extra):
    env = dict(process_env, VLLM_BIN=str(FAKE_VLLM), PANEL_VAR_DIR=str(tmp_path), CPU_HOST_EXCLUSIVE="0",
               DEPLOY_DOWNLOAD_STALL="60")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def add_fake_model(node, folder):
    """Register a local model folder on the node (its agent reads it) and wait until it is a ready copy."""
    from deployments.models import ModelCopy
    from deployments.services import repos

    model = repos.model_add_local(node, str(folder))
    wait_until(lambda: ModelCopy.objects.filter(model=model, node=node, state="ready").exists(), timeout=30,
               message="the local model on the node")
    return model


def deploy(model, node, **kw):
    from deployments.services import deploys

    return deploys.deployment_create(model=model, node=node, gpu_indices=[], port=free_port(), engine_args={},
                                      env={}, **kw)


def settle(d, timeout=60, states=SETTLED):
    from deployments.models import Deployment

    return wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in states and row, timeout=timeout,
                      message=f"deployment {d.pk} to settle in {sorted(states)}")


# --- the true state ------------------------------------------------------------------------------

class ShmWatch:
    """The /dev/shm files of this test's engines, whatever their names: every file an engine of the
    test was seen holding, every file the panel recorded for a deployment row of the test's
    database, every fake-engine file named by the PID of an engine it saw or of such a row, and,
    with `real_names`, every file with the real engine's names that appeared since the test began
    (only where no other real engine can start meanwhile: under the heavy-run lock, or on CI).
    Files with the real engine's names count only once none of the test's engines runs: vLLM's
    sem.mp-* semaphores outlive their last mapping while it serves, until its resource tracker
    unlinks them at its end. Other sessions' engines on a shared host are none of its business."""

    def __init__(self, real_names: bool = False):
        self.pids: set[int] = set()
        self.seen: set[str] = set()
        self.before = set(os.listdir(SHM)) if real_names else None

    def see(self, procs) -> None:
        from deployments.host import processes

        for proc in procs:
            self.pids.add(proc.pid)
            self.seen |= processes._shm_paths_of(proc.pid)

    def ours(self, rows: bool = True) -> set[str]:
        """`rows`: also what this database's deployment rows name (engines that lived between two looks)."""
        from deployments.models import Deployment

        pids, found = set(self.pids), set(self.seen)
        if rows:  # and the files the panel itself recorded for them
            for pid, files in Deployment.objects.values_list("pid", "shm_files"):
                pids.add(pid)
                found |= set(files or [])
        names = os.listdir(SHM)
        found |= {str(SHM / n) for n in names if (m := FAKE_SHM.fullmatch(n)) and int(m[1]) in pids
                  and _made_by(n, int(m[1]))}
        if self.before is not None:
            found |= {str(SHM / n) for n in names if REAL_SHM.fullmatch(n) and n not in self.before}
        if self.running():  # a real engine's resource tracker unlinks, when the engine ends, what it no longer maps
            found = {f for f in found if not REAL_SHM.fullmatch(Path(f).name)}
        return found

    def running(self) -> bool:
        """Whether an engine process this test saw still runs."""
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                continue
        return False


def _made_by(name: str, pid: int) -> bool:
    """Whether the fake engine's file `name` is the one process `pid` made, not a file an earlier fake with the same
    PID left behind (SIGKILLed, it leaves it; PIDs come round again within a suite run at pid_max 32768): made no
    earlier than the process that now has the PID started. Gone, the PID names only its own files."""
    try:
        return (SHM / name).stat().st_mtime >= psutil.Process(pid).create_time() - 1.0
    except (OSError, psutil.Error):
        return True


WATCH: ShmWatch | None = None  # set for each test by tests/faults' autouse fixture (and the e2e kill's)


def _engines(where) -> list[psutil.Process]:
    """Live engine processes for which `where(proc)` holds: those carrying a PANEL_ENGINE marker, and
    vLLM's titled children (VLLM::EngineCore, VLLM::Worker): vLLM's setproctitle writes the title
    over the memory that /proc/<pid>/environ reads, so they no longer show the marker they inherited."""
    from deployments.host import ownership

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            titled = (proc.info["name"] or "").startswith("VLLM::")
            if (titled or ownership.marker_of(proc.pid) is not None) and where(proc):
                found.append(proc)
        except psutil.Error:
            continue
    if WATCH is not None:
        WATCH.see(found)
    return found


def engines_under(folder) -> list[psutil.Process]:
    """Live engine processes (API servers and every child) started for the model in `folder`: they
    run in that folder (engines start in their model's folder) or name it."""
    return _engines(lambda p: p.cwd() == str(folder) or any(str(folder) in c for c in p.info["cmdline"] or []))


def engines_under_any(root) -> list[psutil.Process]:
    """Engine processes running anywhere under `root` (a test's tmp_path)."""
    return _engines(lambda p: p.cwd().startswith(str(root)))


def orphans(folder) -> list[int]:
    """Engine processes for `folder` that no active deployment owns: by their marker, or for vLLM's
    titled children by the marker of their session (a child whose API server is gone has none)."""
    from deployments.host import ownership
    from deployments.models import Deployment

    markers = set(Deployment.objects.filter(status__in=Deployment.ACTIVE).exclude(marker="")
                  .values_list("marker", flat=True))
    running = [(p.pid, ownership.marker_of(p.pid), _session_of(p.pid)) for p in engines_under(folder)]
    of_session = {sid: marker for _, marker, sid in running if marker}
    return [pid for pid, marker, sid in running if (marker or of_session.get(sid)) not in markers]


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def stale_shm() -> list[str]:
    """/dev/shm files of this test's engines (see ShmWatch) that are still there and that no live
    process maps or holds open (by inode: processes.unused_shm)."""
    from deployments.host import processes

    assert WATCH is not None, "no ShmWatch for this test: use tests/faults' fixture or set truestate.WATCH"
    return processes.unused_shm(WATCH.ours())


def assert_true_state(d, folder):
    """What the API says is what runs: ready ⇔ an engine of ours answers and it is the only engine
    for its model folder; otherwise no engine at all. Nothing nobody owns, no stale /dev/shm file."""
    import httpx
    from rest_framework.test import APIClient

    from deployments.host import ownership
    from deployments.models import Deployment
    from tests.factories import UserFactory

    row = Deployment.objects.get(pk=d.pk)
    api = APIClient()
    api.force_authenticate(UserFactory(role="viewer"))
    shown = api.get(f"/api/deployments/{d.pk}/").json()
    assert shown["status"] == row.status, f"the API says {shown['status']}, the row {row.status}"
    running = engines_under(folder)
    if row.status == "ready":
        assert ownership.pid_owned(row.pid, row.marker), f"ready, but PID {row.pid} is not its engine"
        assert row.pid in {p.pid for p in running}, f"ready, but its engine (PID {row.pid}) does not run in {folder}"
        others = [p.pid for p in running if _session_of(p.pid) != row.pgid]  # an engine starts a session of its own
        assert not others, f"ready, but engine processes {others} outside its session {row.pgid} run in {folder} too"
        assert httpx.get(f"http://127.0.0.1:{row.port}/health", timeout=5).status_code == 200
    else:
        assert not running, f"{row.status}, but engine processes {[p.pid for p in running]} run"
    nobodys = orphans(folder)
    assert nobodys == [], f"engine processes that nobody owns: {nobodys}"
    stale = stale_shm()
    assert stale == [], f"stale /dev/shm files: {stale}"


def stop_and_check(d, folder, timeout=30):
    """Stop a ready deployment through the service and check nothing is left behind."""
    from deployments.models import Deployment
    from deployments.services import deploys

    row = Deployment.objects.get(pk=d.pk)
    if row.status == "ready":
        assert_true_state(d, folder)  # (and what its engine holds is seen, for the /dev/shm check after the stop)
    if row.status in Deployment.ACTIVE:
        deploys.deployment_stop(row)
        settle(d, timeout=timeout, states={"stopped", "failed"})
    wait_until(lambda: not engines_under(folder), timeout=15, message="the engine to be gone")
    assert_true_state(d, folder)


def stop_leftover_engines(tmp_path):
    """Never leave an engine or its /dev/shm files behind after a test (engines outlive the agents
    killed here)."""
    from deployments.host import processes

    left = engines_under_any(tmp_path)
    files = set()
    for proc in left:
        files |= processes._shm_paths_of(proc.pid)
        files |= {str(p) for p in SHM.glob(f"psm_fakevllm_{proc.pid}_*")}
        try:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        except OSError:
            pass
    wait_until(lambda: not engines_under_any(tmp_path), timeout=10, message="leftover engines to die")
    if WATCH is not None:
        files |= WATCH.ours(rows=False)
    processes.remove_unused_shm(files)
