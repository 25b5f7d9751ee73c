"""Why an engine ended (deployments/host/exits.py and processes.exit_code): the signal or code of a real process
the agent started, kept even when other children are started and forgotten meanwhile (subprocess's own clean-up
reaps forgotten children), what it means, and the engine's own last lines without the panel's polls."""
import os
import signal
import subprocess
import sys
import time

from deployments.host import exits, processes
from deployments.host.processes import EngineSpec

# What a quiet engine's log ends with after a kill -9: the panel's polls, then nothing.
POLLED = """INFO 12-05 10:00:01 [loader.py:458] Loading weights took 1.52 seconds
ERROR 12-05 10:00:09 [core.py:100] EngineCore hit an exception: CUDA error: out of memory
INFO:     127.0.0.1:50628 - "GET /health HTTP/1.1" 200 OK
INFO:     127.0.0.1:50630 - "GET /metrics HTTP/1.1" 200 OK
INFO:     127.0.0.1:50632 - "GET /v1/models HTTP/1.1" 200 OK
INFO:     127.0.0.1:50634 - "POST /v1/chat/completions HTTP/1.1" 200 OK
INFO:     127.0.0.1:50628 - "GET /health HTTP/1.1" 200 OK""".splitlines()


def _ended(pid: int) -> int:
    deadline = time.monotonic() + 20
    while (code := processes.exit_code(pid)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return code


def test_a_launched_engine_killed_from_outside_says_sigkill_even_after_other_children_came_and_went(tmp_path):
    handle = processes.launch(EngineSpec([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "e.log"))
    os.kill(handle.pid, signal.SIGKILL)
    time.sleep(0.2)
    for _ in range(3):  # forgotten Popen objects: each new Popen's clean-up reaps what it can of ended children
        subprocess.Popen([sys.executable, "-c", "pass"])
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert _ended(handle.pid) == -signal.SIGKILL
    said = exits.explain(processes.exit_code(handle.pid))
    assert said == "killed by SIGKILL (signal 9): killed from outside: by the kernel's OOM killer or by someone's kill -9"


def test_an_engine_that_exits_by_itself_says_its_code(tmp_path):
    handle = processes.launch(EngineSpec([sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "e.log"))
    assert _ended(handle.pid) == 3
    assert exits.explain(3) == "it exited with code 3"
    assert exits.explain(0) == "it exited with code 0 by itself"


def test_an_engine_this_agent_did_not_start_has_no_status_and_oom_kills_are_named():
    assert processes.exit_code(1) is None  # init: running, and not ours
    assert exits.explain(None) == "its exit status is unknown (this agent process did not start it)"
    said = exits.explain(-signal.SIGKILL, oom_killed=2)
    assert said.endswith("; the kernel's OOM killer killed 2 processes on this host meanwhile (out of host memory: see "
                         "dmesg, and the host's free RAM against the model's weights)")
    assert exits.explain(-signal.SIGSEGV).startswith("killed by SIGSEGV (signal 11): it crashed")
    assert isinstance(exits.oom_kills(), int)  # Linux counts them in /proc/vmstat


def test_the_last_lines_are_the_engines_own_not_the_panels_polls():
    assert exits.engine_lines(POLLED) == [POLLED[0], POLLED[1], POLLED[5]]
