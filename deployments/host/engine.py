"""vLLM engine processes on a host: build argv, launch, watch the log, stop (health: host/vllm.py).

The only module that spawns or signals engine processes. Plain Python, no Django.
"""
from __future__ import annotations

import difflib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from deployments.host import engineenv

SHM_DIR = Path("/dev/shm")
# The panel sets these itself; the deploy form and API refuse them too (engineargs.check_flags).
RESERVED_FLAGS = {"--host": "set by the panel", "--port": "set by the panel (the deployment's port)",
                  "--model": "set by the panel from the model"}
_FLAG_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class EngineError(Exception):
    """An engine could not be launched, inspected or stopped; `permanent` means retrying cannot help."""

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.message = message
        self.permanent = permanent


@dataclass
class EngineSpec:
    """Everything needed to start one engine process; env is what the panel sets (engineenv.deployment_env)."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cwd: Path | None = None


@dataclass
class EngineHandle:
    """A launched engine: leader pid and its process group (== its session)."""

    pid: int
    pgid: int
    create_time: float = 0.0


@dataclass
class StopResult:
    """What stop() did: signals sent, time taken, pids still alive, /dev/shm files removed."""

    signals_sent: list[str]
    seconds: float
    survivors: list[int]
    shm_removed: list[str] = field(default_factory=list)


# --- arguments --------------------------------------------------------------------------------


def _flag(name: str) -> str:
    """'tensor_parallel_size' / '--tensor-parallel-size' -> '--tensor-parallel-size'."""
    return "--" + str(name).lstrip("-").replace("_", "-")


def build_argv(vllm_bin: str, model_path: str, port: int, host: str, engine_args: dict) -> list[str]:
    """Turn {"tensor-parallel-size": 8, "enforce-eager": True} into a `vllm serve` argv (no shell)."""
    argv = [str(vllm_bin), "serve", str(model_path), "--host", host, "--port", str(int(port))]
    for name, value in engine_args.items():
        if not _FLAG_RE.match(str(name).lstrip("-")):
            raise EngineError(f"invalid engine flag name {name!r}", permanent=True)
        flag = _flag(name)
        if flag in RESERVED_FLAGS:
            raise EngineError(f"{flag} is {RESERVED_FLAGS[flag]}", permanent=True)
        # False/None leave the engine's default; vLLM spells "off" for on-by-default flags --no-X.
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


@functools.lru_cache(maxsize=8)
def _flags_cached(vllm_bin: str, mtime: float, timeout_s: float) -> frozenset[str]:
    env = engineenv.engine_environ({})
    try:
        out = subprocess.run(
            [vllm_bin, "serve", "--help=all"],
            capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise EngineError(f"`{vllm_bin} serve --help=all` took over {timeout_s:.0f} s") from e
    except OSError as e:
        raise EngineError(f"cannot run {vllm_bin}: {e}", permanent=True) from e
    flags = set()
    for line in out.stdout.splitlines():
        # Option lines are indented 2 spaces: "  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp ..."
        # or "  --enable-prefix-caching, --no-enable-prefix-caching"; descriptions sit deeper.
        if re.match(r"^ {2,4}-", line):
            flags.update(re.findall(r"(?:^|,\s*)(--[a-z0-9][a-z0-9-]*)", line.strip()))
    if out.returncode != 0 or "--port" not in flags:
        raise EngineError(f"`{vllm_bin} serve --help=all` failed: {out.stderr[-500:]}", permanent=True)
    return frozenset(flags)


@functools.lru_cache(maxsize=8)
def _version_cached(vllm_bin: str, mtime: float, timeout_s: float) -> str:
    env = engineenv.engine_environ({})
    try:
        out = subprocess.run([vllm_bin, "--version"], capture_output=True, text=True, timeout=timeout_s, env=env,
                             stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError):
        return ""
    versions = [line.strip() for line in out.stdout.splitlines() if re.match(r"^\d+\.\d+\S*$", line.strip())]
    return versions[-1][:64] if out.returncode == 0 and versions else ""


def engine_version(vllm_bin: str, timeout_s: float = 120.0) -> str:
    """What `vllm --version` says ("0.32.0+cpu"), or "" when it cannot tell (cached per binary)."""
    try:
        mtime = os.stat(vllm_bin).st_mtime
    except OSError:
        return ""
    return _version_cached(str(vllm_bin), mtime, timeout_s)


def engine_flags(vllm_bin: str, timeout_s: float = 120.0) -> set[str]:
    """The `--flags` this engine's `vllm serve` accepts, from its own --help=all (cached per binary)."""
    try:
        mtime = os.stat(vllm_bin).st_mtime
    except OSError as e:
        raise EngineError(f"no engine at {vllm_bin}: {e}", permanent=True) from e
    return set(_flags_cached(str(vllm_bin), mtime, timeout_s))


def validate_args(engine_args: dict, flags: set[str]) -> dict[str, str]:
    """Map each bad key of `engine_args` to a message; unknown flags get a close-match suggestion."""
    errors = {}
    for name in engine_args:
        if not _FLAG_RE.match(str(name).lstrip("-")):
            errors[name] = f"{name!r} is not a valid flag name"
            continue
        flag = _flag(name)
        if flag in RESERVED_FLAGS:
            errors[name] = f"{flag} is {RESERVED_FLAGS[flag]}"
        elif flag not in flags:
            close = difflib.get_close_matches(flag, sorted(flags), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]}?" if close else ""
            errors[name] = f"unknown engine flag {flag}{hint}"
    return errors


# --- processes --------------------------------------------------------------------------------


def launch(spec: EngineSpec) -> EngineHandle:
    """Start the engine in a new session; stdout and stderr are appended to spec.log_path."""
    log_path = Path(spec.log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        try:
            proc = subprocess.Popen(
                spec.argv,
                env=engineenv.engine_environ(spec.env),  # an allowlist: see engineenv
                cwd=spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as e:
            raise EngineError(f"cannot start {spec.argv[0]}: {e}", permanent=True) from e
    try:
        create_time = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        create_time = 0.0
    return EngineHandle(pid=proc.pid, pgid=proc.pid, create_time=create_time)


def _reap(pid: int) -> None:
    # Our own exited children stay zombies (and look alive) until waited for.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def alive(pid: int, create_time: float = 0.0) -> bool:
    """True while `pid` runs (not a zombie); a create_time guards against pid reuse."""
    _reap(pid)
    try:
        proc = psutil.Process(pid)
        if create_time and abs(proc.create_time() - create_time) > 0.01:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def members(pgid: int) -> list[int]:
    """Live pids in process group or session `pgid` (zombies excluded)."""
    found = []
    for pid in psutil.pids():
        try:
            if pgid not in (os.getpgid(pid), os.getsid(pid)):
                continue
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


def _shm_paths_of(pid: int) -> set[str]:
    paths = set()
    proc_dir = Path(f"/proc/{pid}")
    try:
        for fd in (proc_dir / "fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(f"{SHM_DIR}/") and not target.endswith(" (deleted)"):
                paths.add(target)
        # Shared memory is often mmap'd and its fd closed: /proc/pid/maps still names it.
        with open(proc_dir / "maps") as maps:
            for line in maps:
                idx = line.find(f" {SHM_DIR}/")
                if idx != -1 and not line.rstrip().endswith("(deleted)"):
                    paths.add(line[idx + 1 :].rstrip("\n"))
    except OSError:
        pass
    return paths


def shm_files(pgid: int) -> set[str]:
    """/dev/shm files that members of group `pgid` hold open or mapped right now."""
    found = set()
    for pid in members(pgid):
        found |= _shm_paths_of(pid)
    return found


def _is_resource_tracker(pid: int) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    # A member that moved to its own process group is still in the session.
    _signal(members(pgid), sig)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pgid: int, deadline: float, spare_trackers: bool = False) -> list[int]:
    while True:
        _reap(pgid)
        left = members(pgid)
        if spare_trackers:  # also catches children forked while their parents were being killed
            _signal([pid for pid in left if not _is_resource_tracker(pid)], signal.SIGKILL)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def stop(pgid: int, term_timeout_s: float = 30.0, kill_timeout_s: float = 10.0) -> StopResult:
    """SIGTERM the whole group, SIGKILL it on the deadline, verify it is gone, clean its /dev/shm files."""
    if pgid <= 1 or pgid in (os.getpgrp(), os.getsid(0)):
        raise EngineError(f"refusing to stop process group {pgid}: it is not an engine's", permanent=True)
    started = time.monotonic()
    sent: list[str] = []
    shm = shm_files(pgid)  # record before killing: dead processes no longer say what they held
    survivors = members(pgid)
    if survivors:
        _signal_group(pgid, signal.SIGTERM)
        sent.append("SIGTERM")
        survivors = _wait_gone(pgid, time.monotonic() + term_timeout_s)
    if survivors:
        # Python's resource tracker (it ignores SIGTERM) unlinks the semaphores and shared memory
        # its clients registered once they are all dead: kill it last, or vLLM's sem.mp-* and
        # psm_* files leak, some of which no live process maps so nothing else can name them.
        deadline = time.monotonic() + kill_timeout_s
        _signal([pid for pid in survivors if not _is_resource_tracker(pid)], signal.SIGKILL)
        sent.append("SIGKILL")
        survivors = _wait_gone(pgid, time.monotonic() + kill_timeout_s / 2, spare_trackers=True)
        if survivors:
            _signal_group(pgid, signal.SIGKILL)
            # A process in uninterruptible sleep (a stuck GPU driver call) survives even SIGKILL.
            survivors = _wait_gone(pgid, deadline)
    removed = [] if survivors else remove_unused_shm(shm)
    return StopResult(sent, round(time.monotonic() - started, 3), survivors, removed)


def remove_unused_shm(paths: set[str]) -> list[str]:
    """Delete those of `paths` that no live process holds open or mapped (what an engine left)."""
    # Only plain files directly in /dev/shm: the list comes back from the database.
    paths = {p for p in paths if Path(p).parent == SHM_DIR and ".." not in Path(p).parts}
    if not paths:
        return []
    in_use = set()
    for pid in psutil.pids():
        in_use |= _shm_paths_of(pid)
    removed = []
    for path in sorted(paths - in_use):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # already gone: the engine or its resource tracker cleaned up
    return removed


# --- network ----------------------------------------------------------------------------------


def port_free(host: str, port: int) -> bool:
    """True if a server could bind (host, port) now."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    for family, socktype, proto, _, addr in infos:
        with socket.socket(family, socktype, proto) as sock:
            # Same option uvicorn sets, so TIME_WAIT leftovers don't count as busy.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError:
                return False
    return True


# --- log --------------------------------------------------------------------------------------

PHASES = ("starting", "loading_weights", "weights_loaded", "profiling_kv_cache", "graph_capture", "server_up")
# Overall percent at the start of each phase; loading_weights spans 5..60 by shard.
_PHASE_PERCENT = {"starting": 0, "loading_weights": 5, "weights_loaded": 60,
                  "profiling_kv_cache": 65, "graph_capture": 80, "server_up": 100}
_SHARDS_RE = re.compile(r"Loading (?:safetensors |pt |bin )?checkpoint shards:\s*(\d+)% Completed \|\s*(\d+)/(\d+)")
# "Loading weights took 0.01 seconds" (CPU and GPU); "Model loading took 15.2 GiB memory and 11.3 seconds" (GPU).
_WEIGHTS_DONE_RE = re.compile(r"Loading weights took ([\d.]+) s|Model loading took .*? and ([\d.]+) s")
_INIT_DONE_RE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
# Checked against vLLM 0.32's own log calls; torch.compile runs inside the profiling run on GPUs.
_PATTERNS = [
    (re.compile(r"Starting vLLM (?:API )?server|Application startup complete"), "server_up"),
    (re.compile(r"Capturing CUDA graph|Graph capturing finished|CUDA graph pool memory"), "graph_capture"),
    (re.compile(r"Memory profiling takes|Initial profiling/warmup run took|Dynamo bytecode transform"
                r"|Compiling a graph for|torch\.compile t(?:akes|ook)|Profiling CUDA graph memory"
                r"|Estimated CUDA graph memory|Available KV cache memory|KV cache size:"
                r"|Maximum concurrency for"), "profiling_kv_cache"),
    (re.compile(r"Starting to load model"), "loading_weights"),
]
# "(EngineCore pid=5) ERROR 11-29 13:27:56 [core.py:1512] message"; tracebacks come bare.
_LOG_PREFIX_RE = re.compile(r"^(?:\(\S+ pid=\d+\)\s+)?(?:(?P<level>[A-Z]+) \d\d-\d\d [\d:]+ \[[^\]]*\]\s+)?")
_ERROR_RE = re.compile(r"^(?:[\w.]*(?:Error|Exception)\b|CUDA out of memory|Engine core initialization failed"
                       r"|EngineCore failed to start|Worker proc .* died unexpectedly|.*Address already in use)")


@dataclass
class LoadProgress:
    """Follows an engine log to say which loading phase it is in and how far along."""

    phase: str = "starting"
    shards_done: int = 0
    shards_total: int = 0
    shard_percent: int = 0
    weights_seconds: float | None = None
    init_seconds: float | None = None
    error: str | None = None
    last_activity: float = field(default_factory=time.monotonic)
    _first_shard: tuple[float, int] | None = field(default=None, repr=False)
    _last_shard: tuple[float, int] | None = field(default=None, repr=False)

    def feed(self, line: str, now: float | None = None) -> None:
        """Take one log line (tqdm's \\r-separated updates included) and update the state."""
        now = time.monotonic() if now is None else now
        self.last_activity = now
        for part in line.split("\r"):
            self._feed_one(part, now)

    def _advance(self, phase: str) -> None:
        if PHASES.index(phase) > PHASES.index(self.phase):
            self.phase = phase

    def _feed_one(self, text: str, now: float) -> None:
        if m := _SHARDS_RE.search(text):
            self.shard_percent, self.shards_done, self.shards_total = map(int, m.groups())
            if self._first_shard is None:
                self._first_shard = (now, self.shards_done)
            self._last_shard = (now, self.shards_done)
            self._advance("loading_weights")
            return
        if m := _WEIGHTS_DONE_RE.search(text):
            self.weights_seconds = float(m.group(1) or m.group(2))
            self._advance("weights_loaded")
            return
        if m := _INIT_DONE_RE.search(text):
            self.init_seconds = float(m.group(1))
            self._advance("graph_capture")
            return
        for pattern, phase in _PATTERNS:
            if pattern.search(text):
                self._advance(phase)
                return
        prefix = _LOG_PREFIX_RE.match(text)
        message = text[prefix.end() :].strip()
        # The first error is the cause; the ones after it are the engine going down.
        if self.error is None and prefix["level"] in (None, "ERROR", "CRITICAL") and _ERROR_RE.match(message):
            self.error = message

    @property
    def percent(self) -> int:
        """Overall load progress, 0..100."""
        if self.phase == "loading_weights":
            return 5 + (55 * self.shard_percent) // 100
        if self.init_seconds is not None and self.phase != "server_up":
            return 95  # engine ready, API server still starting
        return _PHASE_PERCENT[self.phase]

    @property
    def seconds_left(self) -> float | None:
        """Time left for the weights, from the shard rate so far; None when unknown."""
        if self.phase != "loading_weights" or not (self._first_shard and self._last_shard):
            return None
        (t0, n0), (t1, n1) = self._first_shard, self._last_shard
        if n1 <= n0 or t1 <= t0:
            return None
        return (self.shards_total - n1) * (t1 - t0) / (n1 - n0)

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since the last log line."""
        return (time.monotonic() if now is None else now) - self.last_activity


def read_lines(log_path: Path, offset: int) -> tuple[list[str], int]:
    """Complete lines written after byte `offset`, and the offset to read from next time."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    # Keep a partial last line for the next call; tqdm ends its updates with \r, not \n.
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    text = data[:end].decode("utf-8", errors="replace")
    return [ln for ln in text.split("\n") if ln], offset + end


def tail(log_path: Path, n: int = 50) -> list[str]:
    """The last `n` lines of a log file ([] if it does not exist)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos, data = f.tell(), b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:]
