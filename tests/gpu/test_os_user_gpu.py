"""An engine stand-in started as the engine user on a real NVIDIA GPU: it opens the device nodes
and allocates real GPU memory as that user, NVML attributes the memory to its PID, host/processes.stop gives
it back, and the stand-in can read neither this process's (the agent's) environment nor signal it.

Host modules only, like the rest of this folder (no Django): the whole panel's deploy path is the same
processes.launch with run_as=osuser.current(), tested on the CPU engine in tests/e2e/test_exfiltration.py."""
import errno
import json
import os
import sys
import time
from pathlib import Path

import pytest

from deployments.host import gpu, gpuwait, osuser, processes

pytestmark = pytest.mark.gpu
GIB = 1024**3
ALLOC_GIB = 4
AGENT_SECRET = "agent-secret-gpu-7"
STAND_IN = f"""
import errno, json, os, sys, time, torch
x = torch.ones({ALLOC_GIB} << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
def tried(fn):
    try:
        fn(); return 0
    except OSError as e:
        return e.errno
agent = int(sys.argv[1])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
report = {{"uid": os.getuid(), "nnp": status["NoNewPrivs"].strip(), "key": os.environ.get("VLLM_API_KEY"),
          "environ": tried(lambda: open(f"/proc/{{agent}}/environ", "rb").read()),
          "kill": tried(lambda: os.kill(agent, 0))}}
print("REPORT " + json.dumps(report), flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def user():
    if os.geteuid() != 0:
        pytest.fail("this test switches users: run it as root (the device machine's commands run as root)")
    os.environ["PANEL_AGENT_SECRET"] = AGENT_SECRET  # in this process's environment, as the agent's would be
    return osuser.resolve()


def test_a_stand_in_as_the_engine_user_holds_gpu_memory_that_stop_gives_back(user, gpus, tmp_path):
    assert user.separate and user.uid != 0
    log = tmp_path / "stand-in.log"
    handle = processes.launch(processes.EngineSpec(argv=[sys.executable, "-c", STAND_IN, str(os.getpid()), "--api-key", "sk-gpu-8"],
                                             env={"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                                             log_path=log, run_as=user))
    try:
        deadline = time.monotonic() + 180
        report = None
        while time.monotonic() < deadline and report is None:
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("REPORT ")]
            report = json.loads(lines[0][7:]) if lines else None
            assert processes.alive(handle.pid), log.read_text()[-2000:]
            time.sleep(0.5)
        assert report is not None, log.read_text()[-2000:]
        held = {p.pid: p.used_memory for p in gpu.sample([0])[0].processes or []}
        status = Path(f"/proc/{handle.pid}/status").read_text()
        cmdline = Path(f"/proc/{handle.pid}/cmdline").read_bytes().decode()
        print(f"\nstand-in PID {handle.pid} as {user.describe()}: NVML {held.get(handle.pid, 0) / GIB:.1f} GiB; {report}")
    finally:
        result = processes.stop(handle.pgid, term_timeout_s=5, kill_timeout_s=5)
    assert handle.pid in held and held[handle.pid] >= ALLOC_GIB * GIB, held
    assert f"Uid:\t{user.uid}\t" in status and (report["uid"], report["nnp"]) == (user.uid, "1")
    assert report["key"] == "sk-gpu-8" and "sk-gpu-8" not in cmdline
    assert report["environ"] == errno.EACCES and report["kill"] == errno.EPERM
    assert result.survivors == []
    gpuwait.wait_memory_released([0], [handle.pid], timeout_s=30)
    assert handle.pid not in {p.pid for p in gpu.sample([0])[0].processes or []}
