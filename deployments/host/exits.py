"""Why an engine ended, in words a person can act on: the signal or exit code its leader ended with (kept when the
agent reaped it: host/processes.py exit_code), what that signal usually means, whether the kernel's OOM killer acted meanwhile
(/proc/vmstat's oom_kill counter, which any user may read), and its own last log lines without the panel's polls
(uvicorn's access lines for /health and /metrics that fill a quiet engine's log). Plain Python, no Django."""
from __future__ import annotations

import re
import signal

MEANINGS = {
    "SIGKILL": "killed from outside: by the kernel's OOM killer or by someone's kill -9",
    "SIGTERM": "asked to stop by another process (a kill, a shutdown) that was not the panel",
    "SIGINT": "interrupted (Ctrl-C in a terminal it was attached to)",
    "SIGSEGV": "it crashed (segmentation fault): a bug in the engine or a driver",
    "SIGABRT": "it aborted: a failed assertion or a fatal CUDA or NCCL error (its last lines say which)",
    "SIGBUS": "bus error: often /dev/shm full, or a model file truncated under it",
}
# The panel's own requests in the engine's access log: the agent's /health and /metrics polls, the gateway's
# model lists, the sleep checks. A log that ends in them says nothing of why the engine stopped.
POLL = re.compile(r'"(GET|HEAD) /(health|metrics|ping|v1/models|is_sleeping)\b[^"]*" \d{3}')


def oom_kills() -> int | None:
    """The host's count of processes the OOM killer has killed since boot (None where /proc/vmstat lacks it)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def explain(code: int | None, oom_killed: int = 0) -> str:
    """How a process ended, from its exit code as Popen.returncode gives it (-N: killed by signal N; None: not known
    here), with `oom_killed` OOM kills on the host while it ran (or since it was last seen running)."""
    if code is None:
        said = "its exit status is unknown (this agent process did not start it)"
    elif code < 0:
        sig = -code
        try:
            name = signal.Signals(sig).name
        except ValueError:  # a number no signal of this system has
            name = f"signal {sig}"
        said = f"killed by {name} (signal {sig})" + (f": {MEANINGS[name]}" if name in MEANINGS else "")
    else:
        said = f"it exited with code {code}" + (" by itself" if code == 0 else "")
    if oom_killed:
        said += (f"; the kernel's OOM killer killed {oom_killed} process{'es' if oom_killed > 1 else ''} on this host "
                 "meanwhile (out of host memory: see dmesg, and the host's free RAM against the model's weights)")
    return said


def engine_lines(lines: list[str], n: int = 5) -> list[str]:
    """The last `n` of the engine's own lines: the panel's polls left out."""
    return [line for line in lines if not POLL.search(line)][-n:]
