"""A whole sweep in a child process under a memory limit, its progress streamed back as it happens.

    result = sweep_in_child(spec, on_level=save_point, on_tick=push_live, cancel=stop_requested,
                            memory_bytes=4 * 2**30)

The caller (the node agent, next to the engine) keeps only what it is sent: each level's figures
without the per-request records, and ticks. The child is `python -m benchmarks.runner.child`, started
with subprocess (so a daemonic Celery pool worker may start it too) in its own session, with a bare
environment (none of the agent's secrets); it caps its own memory before it reads the spec
(memory.py) and its measuring processes lower theirs further. Whatever the child does, the worst
is that it dies: its caller reports why and the engine never noticed.

The limit is the child's argument; the protocol is JSON lines: the spec on the child's stdin, then "cancel" lines (EOF also
cancels: a child whose caller died stops); on its stdout {"tick"}, {"level"}, then {"done"} or {"error"}.
The child's own stdout is sent to stderr (a temporary file), whose end explains a crash.
"""
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchmarks.runner.memory as memory  # the module, not the package: its __init__ imports this one
from deployments.host import processes

from .spec import LevelResult, LoadSpec, RunnerError, SweepResult, Tick
from .sweep import sweep, sweep_workers  # already imported by the package's __init__ when run with -m

ROOT = Path(__file__).resolve().parents[2]  # the project, for `-m benchmarks.runner.child`
CANCEL_CHECK_S = 0.2
EXIT_WAIT_S = 30.0
STDERR_SCAN = 64 * 1024  # the end of the child's stderr searched for why it died
# What the child may see of its caller's environment: enough to run Python, not the agent's secrets.
ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", "PYTHONHASHSEED", "SSL_CERT_FILE", "SSL_CERT_DIR")


def sweep_in_child(spec: LoadSpec, on_level=None, on_tick=None, cancel=None, memory_bytes: int = 0) -> SweepResult:
    """runner.sweep() in a child process limited to `memory_bytes` in all (0: memory.auto_bytes());
    callbacks and the cancel check run here. Raises MemoryLimitError when the child ran out of its
    memory, RunnerError for every other failure, as sweep() would."""
    budget = memory_bytes or memory.auto_bytes()
    check = cancel.is_set if hasattr(cancel, "is_set") else (cancel or (lambda: False))
    env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.runner.child", str(budget)], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
        try:
            try:
                proc.stdin.write(json.dumps(dataclasses.asdict(spec)).encode() + b"\n")
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died reading the spec: its exit code and stderr say why
            result, error = _follow(proc, on_level, on_tick, check)
        except BaseException:
            _kill(proc)  # a failing callback, Ctrl-C: the load stops with its caller
            raise
        finally:
            _close(proc)
        code = proc.returncode
        if result is not None:
            return result
        stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - STDERR_SCAN))
        tail = stderr.read().decode("utf-8", "replace")
    mib = budget // memory.MIB
    if error is not None:
        # A measuring process that died of MemoryError left its traceback in the shared stderr.
        if error.get("memory") or memory.out_of_memory(tail):
            raise memory.MemoryLimitError(f"the load generator reached its memory limit ({mib} MiB) and stopped: "
                                          f"{error['message']}")
        raise RunnerError(error["message"], permanent=error.get("permanent"))
    if memory.out_of_memory(tail) or code in (-signal.SIGKILL, -signal.SIGABRT, -signal.SIGSEGV):
        raise memory.MemoryLimitError(f"the load generator died at its memory limit ({mib} MiB), "
                                      f"exit code {code}: {_last_line(tail)}")
    raise RunnerError(f"the load generator exited with code {code}: {_last_line(tail) or 'no message'}")


def _follow(proc, on_level, on_tick, cancelled):
    """Read the child's messages until it ends; (SweepResult, None) or (None, the error it sent)."""
    levels, buffer, next_check, cancel_sent = [], b"", 0.0, False
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if not cancel_sent and now >= next_check:
                next_check = now + CANCEL_CHECK_S
                if cancelled():
                    cancel_sent = _send(proc, b"cancel\n")
            if not selector.select(CANCEL_CHECK_S):
                continue
            data = os.read(proc.stdout.fileno(), 1 << 20)
            if not data:
                return None, None  # ended without a word: the exit code and stderr say why
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "tick" in message and on_tick is not None:
                    on_tick(Tick(**message["tick"]))
                elif "level" in message:
                    level = LevelResult.from_dict(message["level"])
                    levels.append(level)
                    if on_level is not None:
                        on_level(level)
                elif "done" in message:
                    return SweepResult(levels=levels, **message["done"]), None
                elif "error" in message:
                    return None, message["error"]


def _send(proc, data: bytes) -> bool:
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
    except (BrokenPipeError, ValueError):
        pass
    return True


def _kill(proc) -> None:
    """The child and its measuring processes (its session is theirs alone), its resource tracker last:
    the queues, event and barrier they share are named semaphores in /dev/shm, which the tracker unlinks
    once they are dead; what is left of them after that goes too."""
    shm = processes.shm_files(proc.pid)  # before the kill: the dead no longer say what they held
    try:
        proc.kill()
        proc.wait(EXIT_WAIT_S)  # its exit code, before processes.kill() reaps it
    except (OSError, subprocess.TimeoutExpired):
        pass  # stuck in the kernel: processes.kill() says who survived
    if not processes.kill(proc.pid):
        processes.remove_unused_shm(shm)


def _close(proc) -> None:
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass
    try:
        proc.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


# --- the child ------------------------------------------------------------------------------------

def main() -> int:
    budget = int(sys.argv[1])
    memory.limit(memory.split(budget, 1)[0])  # before the spec (uploaded prompts included) is read
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the channel to the caller; fd 1 becomes stderr
    os.dup2(2, 1)
    write_lock = threading.Lock()

    def send(message: dict) -> None:
        line = json.dumps(message)
        with write_lock:
            out.write(line + "\n")

    try:
        fields = json.loads(sys.stdin.readline())
        fields["levels"], fields["rates"] = tuple(fields["levels"]), tuple(fields.get("rates") or ())
        spec = LoadSpec(**fields)
        _, worker = memory.split(budget, sweep_workers(spec)[1])
        cancel = threading.Event()
        threading.Thread(target=_watch_stdin, args=(cancel,), daemon=True).start()
        result = sweep(spec, on_level=lambda level: send({"level": level.to_dict()}),
                       on_tick=lambda tick: send({"tick": dataclasses.asdict(tick)}), cancel=cancel,
                       memory_bytes=worker)
        send({"done": {"cancelled": result.cancelled, "saturated": result.saturated, "capacity": result.capacity}})
        return 0
    except MemoryError:
        send({"error": {"message": "out of memory in the coordinating process", "memory": True}})
        return 1
    except RunnerError as exc:
        if memory.out_of_memory(exc.message):  # a measuring process's MemoryError, its traceback not shown
            send({"error": {"message": "out of memory in a measuring process", "memory": True}})
        else:
            send({"error": {"message": exc.message, "permanent": exc.permanent}})
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug: said to the caller, not swallowed
        send({"error": {"message": f"{type(exc).__name__}: {exc}", "permanent": False}})
        raise


def _watch_stdin(cancel: threading.Event) -> None:
    for line in sys.stdin:
        if line.strip() == "cancel":
            cancel.set()
    cancel.set()  # EOF: the caller is gone or finished


if __name__ == "__main__":
    sys.exit(main())
