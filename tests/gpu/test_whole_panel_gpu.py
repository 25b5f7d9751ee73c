"""The whole panel on a real NVIDIA GPU: the launcher's embedded path (web, control worker, node
agent, embedded Redis, SQLite) registers the GPU node, and a deploy through the REST API runs an engine
stand-in (tests/gpu/standin_vllm.py) as the engine user, whose EngineCore-like child holds real GPU memory.
NVML attributes that memory to the deployment (the node page's live sample, over the WebSocket the page
uses), the stand-in can neither read the environment of any panel process nor signal one nor open the
panel's var/ files, no process of another uid reaches the engine's routes (the loopback door, host/door.py, with
nftables), and Stop gives the memory back. The live path (NVML in the agent, Redis, Channels, the page's WebSocket)
is held to nvidia-smi, read beside it ten times a second: each figure the socket brings, through the load and the
Stop, is one nvidia-smi showed within a tick of the moment the agent read it.

No Django in this process, like the rest of this folder: the panel runs as its own processes and is
reached over HTTP and WebSocket only, as a user's browser or client reaches it."""
import errno
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from websockets.sync.client import connect

from deployments.host import door, gpu
from tests.conftest import ROOT, free_port, wait_until

pytestmark = pytest.mark.gpu
GIB = 1 << 30
HOLD_GIB = 4
NODE = "gpu-whole-panel"
# Variables of this pytest process (controlpanel/pytest_env.py) that are not the embedded path's: without
# them the launcher makes its own secret key file, database, Redis and password hashing, as for a user.
NOT_THE_PANELS = ("SECRET_KEY", "SECRET_KEY_FILE", "DATABASE_URL", "REDIS_URL", "PANEL_TEST_PASSWORD_HASHER",
                  "CHANNELS_PREFIX", "HF_TOKEN_KEY_FILE", "DB_CONN_MAX_AGE", "MODEL_STORE", "VLLM_BIN")


class Panel:
    """`python -m panelctl.launcher start` in a folder of its own, logged in as its first admin."""

    def __init__(self, base: Path, vllm: Path):
        self.base, self.var = base, base / "var"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(16)
        env = {k: v for k, v in os.environ.items() if k not in NOT_THE_PANELS}
        env.update(PANEL_VAR_DIR=str(self.var), VLLM_BIN=str(vllm), PANEL_ADMIN_USER="admin",
                   PANEL_ADMIN_PASSWORD=self.password, PYTHONUNBUFFERED="1",
                   LOCAL_MODEL_ROOTS=str(base))  # the test's model folders, as an admin would declare them
        self.log = base / "panel.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "panelctl.launcher", "start", "--port", str(self.port),
                                          "--gateway-port", str(free_port()), "--node-name", NODE], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def tail(self, n=6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_up(self, timeout=180) -> None:
        def up():
            if self.proc.poll() is not None:
                pytest.fail(f"the launcher exited with {self.proc.returncode}:\n{self.tail()}")
            return "vLLM panel is up" in self.log.read_text(errors="replace")
        wait_until(up, timeout, message="the launcher's 'vLLM panel is up'", interval=0.2)

    def login(self) -> None:
        self.http.get("/accounts/login/").raise_for_status()
        answer = self.http.post("/accounts/login/", data={"username": "admin", "password": self.password,
                                                          "csrfmiddlewaretoken": self.http.cookies["csrftoken"]})
        assert answer.status_code == 302 and "sessionid" in self.http.cookies, answer.text[-2000:]
        self.http.headers["X-CSRFToken"] = self.http.cookies["csrftoken"]

    def get(self, path: str) -> dict:
        answer = self.http.get(path)
        assert answer.status_code == 200, f"GET {path}: {answer.status_code} {answer.text[:2000]}"
        return answer.json()

    def find(self, path: str) -> dict | None:
        """GET `path`, or None while it is 404 (a node not registered yet)."""
        answer = self.http.get(path)
        return None if answer.status_code == 404 else self.get(path)

    def post(self, path: str, body: dict | None = None) -> dict:
        answer = self.http.post(path, json=body or {})
        assert answer.status_code == 202, f"POST {path}: {answer.status_code} {answer.text[:2000]}"
        return answer.json()

    def live(self):
        """The WebSocket the node page listens on, with this session's cookies."""
        cookie = "; ".join(f"{k}={v}" for k, v in self.http.cookies.items())
        return connect(f"ws://127.0.0.1:{self.port}/ws/live/", additional_headers={"Cookie": cookie, "Origin": self.url},
                       open_timeout=15)

    def processes(self) -> list[psutil.Process]:
        """The launcher and everything it runs that is still root's (web, worker and its pool, agent, Redis)."""
        top = psutil.Process(self.proc.pid)
        return [p for p in [top, *top.children(recursive=True)] if p.uids().real == 0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.http.close()


@pytest.fixture
def base():
    """A folder every user may enter (pytest's tmp_path lies under a 0700 folder): the engine user must
    reach the stand-in and the model folder; the launcher keeps var/ inside it private itself."""
    if os.geteuid() != 0:
        pytest.fail("the agent starts engines as another user only as root (the device machine's commands run as root)")
    folder = Path(tempfile.mkdtemp(prefix="gpu-whole-panel-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _stand_in(base: Path) -> Path:
    """The stand-in as an executable `vllm` run by this interpreter (the one with torch), the fake beside it."""
    engine = base / "engine"
    engine.mkdir(mode=0o755)
    vllm = engine / "vllm"
    vllm.write_text(f"#!{sys.executable}\n" + (ROOT / "tests" / "gpu" / "standin_vllm.py").read_text())
    vllm.chmod(0o755)
    shutil.copy(ROOT / "tests" / "faults" / "fakevllm" / "vllm", engine / "fakevllm")
    (engine / "fakevllm").chmod(0o644)
    shutil.copy(ROOT / "tests" / "gpucorpus.py", engine / "gpucorpus.py")  # for a "replay" in fake_engine.json
    (engine / "gpucorpus.py").chmod(0o644)
    for extra in ("fakeproto.py", "serve-flags.txt"):  # the fake's own files, beside it
        shutil.copy(ROOT / "tests" / "faults" / "fakevllm" / extra, engine / extra)
        (engine / extra).chmod(0o644)
    return vllm


def _model(base: Path, probe: list[str], name: str = "gpu-stand-in", **config) -> Path:
    """A model folder for the stand-in (fake_engine.json: `config` besides its load time, memory and probe)."""
    folder = base / "models" / name
    folder.mkdir(parents=True)
    for path in (folder.parent, folder):
        path.chmod(0o755)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                                    "vocab_size": 256}))
    (folder / "fake_engine.json").write_text(json.dumps({"load_s": 1.0, "gpu_gib": HOLD_GIB, "probe": probe, **config}))
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


class Smi:
    """nvidia-smi's memory.used of GPU 0 (MiB), read about ten times a second in a thread: [(Unix time, MiB)]."""

    def __init__(self):
        self.readings: list[tuple[float, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            before = time.time()
            out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                self.readings.append(((before + time.time()) / 2, int(out.stdout.strip())))
            self.done.wait(0.1)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(40)


class Live:
    """The node's live samples as the page's WebSocket brings them, collected in a thread:
    [(Unix time received, the sample)]."""

    def __init__(self, panel: "Panel", node_id: int):
        self.socket = panel.live()
        self.socket.send(json.dumps({"subscribe": [f"node:{node_id}"]}))
        self.samples: list[tuple[float, dict]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                message = json.loads(self.socket.recv(timeout=0.5))
            except TimeoutError:
                continue
            if message.get("kind") == "sample":
                self.samples.append((time.time(), message["data"]))

    def stop(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.thread.join(10)
            self.socket.close()


TICK_S = 1.0  # the agent samples every second (deployments/agent.py)


def _matching(live: Live, smi: Smi) -> tuple[list, list]:
    """(matched, unmatched): each live GPU 0 figure with the nvidia-smi reading that showed it within a tick of the
    moment the agent read it (MiB, nvidia-smi's rounding), or alone when none did. Within a tick on either side: a
    figure read just after the memory moved (a Stop's release) is shown by nvidia-smi's next reading, taken after it
    (the H200 failed twice on "within the tick before the socket brought it": 22 MiB read 9 ms before it arrived,
    every earlier nvidia-smi reading still the engine's)."""
    matched, unmatched = [], []
    for received, sample in live.samples:
        mib = (sample["gpus"][0]["memory_used"] or 0) / 2**20
        seen = [(t, m) for t, m in smi.readings if abs(t - sample["t"]) <= TICK_S and abs(m - mib) <= 1]
        (matched if seen else unmatched).append((received, sample["t"], round(mib), seen[-1] if seen else None))
    return matched, unmatched


def _held(pid: int) -> int:
    return next((p.used_memory or 0 for p in gpu.sample([0])[0].processes or [] if p.pid == pid), 0)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_whole_panel_deploys_a_gpu_stand_in_as_the_engine_user_and_stop_gives_the_memory_back(gpus, base):
    vllm = _stand_in(base)
    panel = Panel(base, vllm)
    d = None
    figures = {}
    smi = live = None
    done = False
    try:
        started = time.monotonic()
        panel.wait_up()
        panel.login()
        node = wait_until(lambda: (n := panel.find(f"/api/nodes/{NODE}/")) and n["online"] and n["gpus"] and n["engine_version"] and n,
                    90, message=f"node {NODE} to register with its GPUs and engine version")
        figures["registered_s"] = time.monotonic() - started
        assert node["gpus"][0]["uuid"] == gpus[0].uuid and node["gpus"][0]["memory_total"] == gpus[0].memory_total, node["gpus"]

        # What the stand-in is to try to open: the panel's private files (the secret key the launcher made,
        # the SQLite database) and var/ itself, which an engine may enter but not list.
        private = [str(panel.var / "secret_key"), str(panel.var / "panel.sqlite3"), str(panel.var)]
        assert all(os.path.exists(p) for p in private), private
        model = panel.post("/api/models/", {"node": NODE, "local_path": str(_model(base, private))})
        wait_until(lambda: [c for c in panel.get(f"/api/copies/?node={NODE}&model={model['id']}")["results"] if c["state"] == "ready"],
             60, message="the local model's copy on the node to be ready")

        smi = Smi()  # reading before the first live sample can come: each figure needs its tick of readings
        wait_until(lambda: len(smi.readings) >= 3 and smi.readings[-1][0] - smi.readings[0][0] >= TICK_S, 60,
                   message="nvidia-smi's first readings", interval=0.05)
        live = Live(panel, node["id"])
        before = gpu.sample([0])[0]
        asked = time.monotonic()
        d = panel.post("/api/deployments/", {"model": model["id"], "node": NODE, "gpus": [0], "preset": "none",
                                             "name": "gpu-stand-in"})
        d = wait_until(lambda: (row := panel.get(f"/api/deployments/{d['id']}/"))["status"] in ("ready", "failed", "stopped") and row,
                 180, message="the deployment to settle")
        figures["ready_s"] = time.monotonic() - asked
        log = Path(d["log_path"]).read_text(errors="replace")
        assert d["status"] == "ready", f"{d['status']}: {d['status_message']}\n{log[-3000:]}\n{panel.tail()}"
        report = json.loads(next(line for line in log.splitlines() if line.startswith("GPU-STAND-IN "))[len("GPU-STAND-IN "):])
        holder = report["pid"]
        engine_uid = psutil.Process(holder).uids().real

        # NVML: the child holds the memory, as the engine user, in the deployment's process group.
        held = _held(holder)
        figures.update(held_gib=round(held / GIB, 2), holder=holder, engine_pid=d["pid"], engine_uid=engine_uid)
        assert held >= HOLD_GIB * GIB, gpu.sample([0])[0].processes
        assert engine_uid != 0 and report["uid"] == engine_uid and report["no_new_privs"] == "1", report
        assert holder != d["pid"] and os.getpgid(holder) == os.getpgid(d["pid"])
        # The panel says whose it is: the node page's live sample labels the process with the deployment.
        def labelled_sample():
            for _, sample in reversed(live.samples):
                found = next((p for p in sample["gpus"][0]["processes"] or [] if p["pid"] == holder and p.get("deployment")), None)
                if found:
                    return found
            return None

        labelled = wait_until(labelled_sample, 30, message="a live sample labelling the stand-in's GPU process with its deployment")
        assert labelled["deployment"] == {"id": d["id"], "name": "gpu-stand-in"} and labelled["used_memory"] >= HOLD_GIB * GIB

        # The loopback door: the engine's routes answer the agent's uid (root, as this test) and no other, the
        # engine's own user included; every route refused before HTTP, as the doctor's exposure audit asks them.
        port = d["port"]
        shut, why = door.door_check()
        assert shut, f"the door cannot be shut here: {why}"
        assert door.door_ports().get(port) == NODE, door.door_ports()
        routes = ["/health", "/v1/models", "/v1/chat/completions", "/invocations", "/tokenize", "/metrics"]
        as_root = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code
        asked_as = {uid: door.ask_as(uid, {port: routes})[port] for uid in (door.NOBODY, engine_uid)}
        assert as_root == 200, as_root
        for uid, answers in asked_as.items():
            assert not [r for r, status in answers.items() if isinstance(status, int)], (uid, answers)
        figures["door"] = {uid: sorted(set(a.values())) for uid, a in asked_as.items()}

        # The boundary: every panel process's environment closed to it, every signal refused, var/ closed.
        panel_pids = {str(p.pid): " ".join(p.cmdline()[:4]) for p in panel.processes()}
        agent = next(pid for pid, cmd in panel_pids.items() if "nodeagent" in cmd)
        probed = {pid: (report["environ"][pid], report["kill"][pid]) for pid in panel_pids if pid in report["environ"]}
        for role in ("nodeagent", "uvicorn", "celery", "redis-server", "panelctl.launcher"):
            assert any(role in panel_pids[pid] for pid in probed), f"{role} was not probed: {panel_pids} {sorted(probed)}"
        assert probed[agent] == (errno.EACCES, errno.EPERM)
        assert set(probed.values()) == {(errno.EACCES, errno.EPERM)}, {panel_pids[p]: v for p, v in probed.items()}
        assert [pid for pid, e in report["environ"].items() if e == 0] == []  # no other user's environment at all
        assert report["files"] == {p: errno.EACCES for p in private}, report["files"]

        stop_asked = time.monotonic()
        panel.post(f"/api/deployments/{d['id']}/stop/")
        wait_until(lambda: _held(holder) == 0 and gpu.sample([0])[0].memory_used <= before.memory_used + 512 * 2**20,
             60, message=f"GPU memory of PID {holder} back", interval=0.05)
        figures["memory_back_s"] = time.monotonic() - stop_asked
        stopped = wait_until(lambda: (row := panel.get(f"/api/deployments/{d['id']}/"))["status"] in ("stopped", "failed") and row,
                       60, message="the deployment to show stopped")
        assert stopped["status"] == "stopped", stopped["status_message"]
        time.sleep(2 * TICK_S)  # the samples after the memory came back
        live.stop()
        smi.stop()
        matched, unmatched = _matching(live, smi)
        figures.update(live_samples=len(live.samples), smi_readings=len(smi.readings))
        assert len(live.samples) >= 5 and len(smi.readings) >= 20, figures
        assert unmatched == [], f"live figures nvidia-smi never showed within a tick: {unmatched[:5]} ({len(matched)} matched)"
        levels = {m[2] for m in matched}
        assert max(levels) - min(levels) >= HOLD_GIB * 1024, f"the live figures never followed the load and Stop: {sorted(levels)}"
        lag = [received - t for received, t, _, _ in matched]
        wait_until(lambda: port not in door.door_ports(), 10, message=f"port {port} out of the door's set after Stop")
        # Exited is gone, as the panel counts it (host/processes.py): a zombie waits only for its parent's wait().
        wait_until(lambda: not _running(holder) and not _running(d["pid"]), 10, message="the engine's processes to end")
        zombies = [f"{pid} (zombie, parent {psutil.Process(pid).ppid()})" for pid in (holder, d["pid"]) if psutil.pid_exists(pid)]
        print(f"\nwhole panel on {report['device']} (GPU {gpus[0].uuid}): node registered {figures['registered_s']:.1f} s after "
              f"start; deploy -> ready {figures['ready_s']:.1f} s; NVML: EngineCore PID {holder} (uid {engine_uid}, "
              f"no_new_privs, group of engine PID {d['pid']}) holds {held / GIB:.2f} GiB, the node page labels it "
              f"{labelled['deployment']['name']!r}; the stand-in probed {len(probed)} panel processes (agent PID {agent}): "
              f"environ EACCES and kill(pid, 0) EPERM for each, other users' environments readable: 0, var files "
              f"{sorted(set(report['files'].values()))} (EACCES={errno.EACCES}); Stop -> memory back in "
              f"{figures['memory_back_s']:.2f} s, no process left running; the door: port {port} answered root /health 200, "
              f"uid {door.NOBODY} and the engine's uid {engine_uid}: {figures['door']} on every route; live path: "
              f"{len(matched)} WebSocket samples from {min(levels)} to {max(levels)} MiB, each one nvidia-smi showed "
              f"within {TICK_S:.0f} s of its reading ({len(smi.readings)} nvidia-smi readings), sample to socket "
              f"median {sorted(lag)[len(lag) // 2] * 1000:.0f} ms, max {max(lag) * 1000:.0f} ms" + (f" ({', '.join(zombies)})" if zombies else ""))
        done = True
    finally:
        for feed in (live, smi):
            if feed is not None:
                feed.stop()
        if not done:
            print(f"\n--- figures so far: {figures}; the panel's log (end) ---\n{panel.tail(8000)}")
        if d and d.get("pid") and psutil.pid_exists(d["pid"]):  # the test failed midway: the engine must not outlive it
            try:
                panel.post(f"/api/deployments/{d['id']}/stop/")
                wait_until(lambda: not psutil.pid_exists(d["pid"]), 30, message="the engine to stop")
            except BaseException:  # noqa: BLE001 - kill it whatever the panel says
                os.killpg(os.getpgid(d["pid"]), signal.SIGKILL)
        panel.stop()
