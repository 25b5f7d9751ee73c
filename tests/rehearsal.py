"""The seed day's world for tests/e2e/test_seed_rehearsal.py and perf/seed_rehearsal.py: one host with 8 simulated
GPUs (96 GB, compute capability 12.0, a display server on GPU 0: the NVML double), the fake engine as `vllm`
(tests/faults/fakevllm, with the GPU log corpus replayed as its load and tests/schedserver.py answering), the Hub
double holding a Kimi-like repo of 64 shards, a MiniMax-like model already on the node, an old 540 GB-class copy
(sparse files) to delete, and the systemctl double (tests/faults/systemd/systemctl) for units and reboots.

Where a reboot happens is one seam: `Host.reboot()` (SIGKILL the agent, the gateway, every engine and every unit;
boot: start the enabled units; start the agent and the gateway again). A host with the real systemd replaces this
class (same three methods: start, reboot, stop).

Sizes: `Size.ci()` fits a few minutes on 2 cores; `Size.full()` is the day's (64 shards of real bytes, the corpus at
1x, 2,000-token reasoning answers); REHEARSAL_SHARD_MB, REHEARSAL_SPEED override either."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import gpucorpus, nvmldouble
from tests.conftest import ROOT, agent_argv, wait_until
from tests.truestate import FAKE_VLLM, agent_env

CONFIGS = ROOT / "tests" / "fixtures" / "configs"
SYSTEMCTL = ROOT / "tests" / "faults" / "systemd"
NVML_PYNVML = ROOT / "tests" / "e2e" / "nvml_double"
KIMI, OLD = "moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2-Instruct"
GPUS = 8
GPU_MIB = 97_887  # an RTX PRO 6000 Blackwell Server Edition as NVML reports it (96 GB)
DISPLAY_MIB = 180  # what Xorg holds on GPU 0
MB = 1 << 20


@dataclass
class Size:
    shards: int = 64
    shard_bytes: int = 96 * 1024
    old_copy_bytes: int = 540 * 10**9  # sparse: the size a listing shows, no disk used
    corpus_speed: float = 400.0  # the 36-minute corpus in ~5 s
    levels: list = field(default_factory=lambda: [1, 16, 128, 1024])
    max_tokens: int = 24
    reasoning_tokens: int = 16
    gap_ms: float = 0.5
    repeats: int = 3  # the fewest an interval is drawn from (benchmarks/studystats.py)
    stall_s: float = 61.0  # past the download's 60 s read timeout (deployments/host/downloads.READ_TIMEOUT_S)

    @classmethod
    def ci(cls) -> "Size":
        return cls()._overridden()

    @classmethod
    def full(cls, shard_mb: int = 256) -> "Size":
        return cls(
            shard_bytes=shard_mb * MB,
            corpus_speed=1.0,
            max_tokens=2048,
            reasoning_tokens=2000,
            gap_ms=2.0,
            repeats=3,
            stall_s=65.0,
        )._overridden()

    def _overridden(self) -> "Size":
        if mb := os.environ.get("REHEARSAL_SHARD_MB"):
            self.shard_bytes = int(float(mb) * MB)
        if speed := os.environ.get("REHEARSAL_SPEED"):
            self.corpus_speed = float(speed)
        if tokens := os.environ.get("REHEARSAL_MAX_TOKENS"):  # reasoning takes all but 48 of them
            self.max_tokens, self.reasoning_tokens = int(tokens), max(int(tokens) - 48, 1)
        if stall := os.environ.get("REHEARSAL_STALL_S"):  # below 60 s the server's close ends it, not the read timeout
            self.stall_s = float(stall)
        return self

    @property
    def timeout_s(self) -> float:
        """The test's bound: a few minutes, and the corpus's 36 minutes at its speed twice (the day's load, and the
        reboot's when it is not fast by then), and the shards at 20 MB/s twice (the Hub double's and the copy's)."""
        return 600 + 2 * 2110 / self.corpus_speed + 2 * self.shards * self.shard_bytes / (20 * MB)

    @classmethod
    def chosen(cls) -> "Size":
        return cls.full() if os.environ.get("REHEARSAL_SIZE") == "full" else cls.ci()


def _readable(path: Path) -> Path:
    """Every folder and file under `path` readable by the engine user (the agent runs engines as another user)."""
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644)
    return path


def engine(base: Path) -> Path:
    """The fake engine as `vllm`, run by a Python of its own that holds fastsafetensors (a stub package: the panel
    checks the engine's Python can import it before a launch, the fake that it is there when the flag asks for it)."""
    venv = base / "engine-python"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "fastsafetensors").mkdir()
    (site / "fastsafetensors" / "__init__.py").write_text(
        '"""A stub: found by the panel\'s and the fake\'s checks."""\n'
    )
    folder = base / "engine"
    folder.mkdir()
    vllm = folder / "vllm"
    vllm.write_text(
        f"#!{venv}/bin/python3\nimport os, runpy, sys\nsys.argv[0] = {str(FAKE_VLLM)!r}\n"
        "os.environ['FAKEVLLM_FULL_HELP'] = '1'  # as vLLM's --help=all: every flag it takes\n"
        f"runpy.run_path({str(FAKE_VLLM)!r}, run_name='__main__')\n"
    )
    vllm.chmod(0o755)
    _readable(venv)
    _readable(folder)
    return vllm


def _shard_header(n_bytes: int) -> bytes:
    """A safetensors file's header for one uint8 tensor filling the rest of the file."""
    body = n_bytes - 8
    header = b""
    for _ in range(3):  # the header's length changes the data's, settle it
        header = json.dumps(
            {
                "w": {
                    "dtype": "U8",
                    "shape": [max(body - len(header), 0)],
                    "data_offsets": [0, max(body - len(header), 0)],
                }
            }
        ).encode()
    header = header.ljust(len(header) + (-len(header)) % 8)
    return len(header).to_bytes(8, "little") + header


def write_shard(path: Path, n_bytes: int, seed: int, sparse: bool = False) -> None:
    """A safetensors file of `n_bytes`: real bytes (seeded, not zeros: a resume must continue the right bytes), or
    a sparse one (the old copy's 540 GB take no disk)."""
    head = _shard_header(n_bytes)
    with open(path, "wb") as f:
        f.write(head)
        if sparse:
            f.truncate(n_bytes)
            return
        left, block = (n_bytes - len(head), bytes((seed * 31 + i) % 251 for i in range(1 << 16)))
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)


def _model_folder(folder: Path, config: str, shards: int, shard_bytes: int, sparse: bool = False, **fake) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((CONFIGS / config).read_text())
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, name in enumerate(names):
        write_shard(folder / name, shard_bytes, i, sparse)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": shards * shard_bytes}, "weight_map": {f"w{i}": n for i, n in enumerate(names)}}
        )
    )
    if fake:
        (folder / "fake_engine.json").write_text(json.dumps(fake))
    return _readable(folder)


def serving(size: Size, loader: str | None = None) -> dict:
    """fake_engine.json: tests/schedserver.py answers (reasoning first, then content); with `loader`, the corpus of
    that weights loader is the load's log, at the size's speed."""
    config = {
        "load_s": 0.5,
        "python": sys.executable,
        "schedules": {
            "*": {"ttft_ms": 5, "gap_ms": size.gap_ms, "tokens_per_chunk": 1, "reasoning_tokens": size.reasoning_tokens}
        },
    }
    if loader:
        config |= {"replay": str(gpucorpus.path(loader)), "replay_speed": size.corpus_speed}
    return config


def hub_repos(root: Path, size: Size) -> Path:
    """The Hub double's folder: the Kimi-like repo, 64 shards of real bytes, its engine settings beside them."""
    _model_folder(root / KIMI, "kimi-k2.5-int4.json", size.shards, size.shard_bytes, **serving(size, "fastsafetensors"))
    _model_folder(root / OLD, "kimi-k2-instruct.json", 62, 4096)  # yesterday's model, a copy of it on the node
    return root


def local_models(base: Path, size: Size) -> Path:
    """The MiniMax-like model the node serves this morning (a folder of its own, added as a local model)."""
    return _model_folder(base / "models" / "MiniMax-M2.5", "minimax-m2.5.json", 4, 64 * 1024, **serving(size))


def grow_sparse(folder: Path, total: int) -> int:
    """Yesterday's copy as it was: its shards grown to `total` bytes in all, sparse (a listing shows them, no disk is
    used); the bytes its files now add up to."""
    shards = sorted(folder.glob("*.safetensors"))
    for shard in shards:
        os.truncate(shard, total // len(shards))
    return sum(p.stat().st_size for p in shards)


def gpus(folder: Path, display_pid: int) -> Path:
    nvmldouble.write_model(
        folder,
        GPUS,
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        GPU_MIB,
        (12, 0),
        {0: [(display_pid, DISPLAY_MIB, "/usr/lib/xorg/Xorg")]},
    )
    nvmldouble.SharedMemory(folder).set([DISPLAY_MIB * MB] + [0] * (GPUS - 1))
    return folder


class Host:
    """The GPU host as the systemctl double runs it: the node agent and its gateway as processes of this test, the
    engines' units under the double. start() / reboot() / stop(): the seam a booted container with the real
    systemd replaces."""

    def __init__(self, spawn, process_env, base: Path, name: str, vllm: Path, hub: str, display_pid: int):
        self.spawn, self.base, self.name = spawn, base, name
        units = {
            "PATH": f"{SYSTEMCTL}:{os.environ['PATH']}",
            "SYSTEMD_UNIT_PATH": str(base / "units"),
            "SYSTEMCTL_DOUBLE_STATE": str(base / "systemd-state"),
            "ENGINE_UNIT_RESTART_SEC": "1",
        }
        (base / "units").mkdir()
        for k, v in units.items():  # this process's systemctl calls (the reboot's boot) see the same double
            os.environ[k] = v
        self.env = agent_env(
            process_env,
            base,
            **units,
            VLLM_BIN=vllm,
            HF_ENDPOINT=hub,
            DOWNLOAD_RETRY_FIRST_S="0.2",
            # The schedule server runs on this venv's Python, under /root, which the engine user cannot enter (as in
            # tests/e2e/test_study_page.py).
            PANEL_ENGINE_USER="root",
            NVML_DOUBLE=gpus(base / "nvml", display_pid),
            PYTHONPATH=f"{NVML_PYNVML}:{process_env.get('PYTHONPATH') or ROOT}",
        )
        self.agent = self.gateway = None
        self.gateway_url = ""

    def start(self) -> None:
        from deployments.models import Node

        self.agent = self.spawn(
            agent_argv(self.name, self.base / "store", sample_seconds=1, heartbeat_seconds=1),
            self.env,
            name=f"agent-{self.name}",
        )
        wait_until(
            lambda: Node.objects.filter(name=self.name, agent_pid=self.agent.pid).exists(),
            timeout=90,
            message="the agent to register",
        )
        self.gateway = self.spawn(
            [
                sys.executable,
                "manage.py",
                "gateway",
                "--node",
                self.name,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--ready-wait",
                "5",
            ],
            self.env,
            name=f"gateway-{self.name}",
        )
        found = wait_until(
            lambda: re.search(rb"listening on http://127\.0\.0\.1:(\d+)", Path(self.gateway.log_path).read_bytes()),
            timeout=60,
            message="the gateway",
        )
        self.gateway_url = f"http://127.0.0.1:{int(found.group(1))}"

    def reboot(self, markers: list[str]) -> None:
        """Everything on the host SIGKILLed at once (the engines of `markers`, the units' supervisors, the agent,
        the gateway), then boot: every enabled unit started, the agent and the gateway started again."""
        from deployments.host import ownership

        state = self.base / "systemd-state"
        supervisors = [json.loads(f.read_text()).get("supervisor") for f in state.glob("*.json")]
        groups = {os.getpgid(p) for m in markers for p in ownership.find(m) if _alive(p)}
        for proc in (self.agent, self.gateway):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in supervisors:
            _kill(pid, os.kill)
        for group in groups:
            _kill(group, os.killpg)
        wait_until(lambda: not any(ownership.find(m) for m in markers), timeout=15, message="every engine gone")
        boot = subprocess.run(["systemctl", "__boot"], capture_output=True, text=True, timeout=60)
        assert boot.returncode == 0, boot.stderr
        self.start()

    def unit(self, name: str) -> dict:
        """`systemctl show` of a unit: MainPID, ActiveState, UnitFileState."""
        out = subprocess.run(
            ["systemctl", "show", "-p", "MainPID,ActiveState,UnitFileState", name],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **self.env},
        ).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def stop(self) -> None:
        """No unit's supervisor outlives the test (the agent and gateway are spawn's to kill)."""
        for f in (self.base / "systemd-state").glob("*.json"):
            _kill(json.loads(f.read_text()).get("supervisor"), os.kill)
        for f in (self.base / "systemd-state").glob("*.enabled"):
            f.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _kill(pid, how) -> None:
    try:
        if pid:
            how(pid, signal.SIGKILL)
    except OSError:
        pass


class Clock:
    """Each step's wall time and what the panel said, printed as the day goes (pytest -s shows it)."""

    def __init__(self):
        self.steps: list[tuple[str, float, str]] = []
        self.began = time.monotonic()

    def step(self, name: str):
        clock = self

        class _Step:
            said: list[str] = []

            def __enter__(self):
                self.t0 = time.monotonic()
                self.said = []
                print(f"\n== {name}", flush=True)
                return self

            def say(self, text: str) -> None:
                self.said.append(text)
                print(f"   panel: {text}", flush=True)

            def __exit__(self, *exc):
                took = time.monotonic() - self.t0
                clock.steps.append((name, took, self.said[-1] if self.said else ""))
                print(f"   {name}: {took:.1f} s{' (FAILED)' if exc[0] else ''}", flush=True)

        return _Step()

    def summary(self) -> str:
        rows = [f"{name:<44} {took:8.1f} s" for name, took, _ in self.steps]
        return "\n".join(rows + [f"{'the whole day':<44} {time.monotonic() - self.began:8.1f} s"])
