"""The sleep probe on a real NVIDIA GPU, through the whole panel (the launcher's embedded path, the REST API): the GPU
stand-in (tests/gpu/standin_vllm.py), whose EngineCore-like child frees real GPU memory on sleep and takes it again
on wake, is probed on demand. Each figure the probe records for a level (its holder's GPU memory before, asleep and
after) is one nvidia-smi showed for that process, read beside it ten times a second. A stand-in whose sleep frees
nothing (vLLM 0.14-0.15's sleep) is refused: its first sleep is probed first and not done, the next is refused by the
API with the probe's figures."""
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.gpu.test_whole_panel_gpu import HOLD_GIB, NODE, Panel, _model, _stand_in, base  # noqa: F401 - base: a fixture

pytestmark = pytest.mark.gpu
GIB, MIB = 1 << 30, 1 << 20


class SmiApps:
    """nvidia-smi's per-process used memory on GPU 0 (MiB), read about ten times a second: [(Unix time, {pid: MiB})]."""

    def __init__(self):
        self.readings: list[tuple[float, dict[int, int]]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            out = subprocess.run(["nvidia-smi", "-i", "0", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                apps = {}
                for line in out.stdout.strip().splitlines():
                    pid, _, mib = line.partition(",")
                    if pid.strip().isdigit() and mib.strip().isdigit():
                        apps[int(pid)] = int(mib)
                self.readings.append((time.time(), apps))
            self.done.wait(0.1)

    def showed(self, pid: int, figure: int) -> bool:
        """Whether nvidia-smi showed `pid` holding `figure` bytes (to its MiB rounding; 0: not listed or 0 MiB)."""
        return any(abs(apps.get(pid, 0) * MIB - figure) <= MIB for _, apps in self.readings)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(40)


def _deploy(panel: Panel, base: Path, name: str, **config) -> tuple[int, int]:
    """(deployment id, the PID holding its GPU memory) of a ready sleep-mode stand-in on GPU 0."""
    model = panel.post("/api/models/", {"node": NODE, "local_path": str(_model(base, [], name, weights_mb=64, **config))})
    wait_until(lambda: [c for c in panel.get(f"/api/copies/?node={NODE}&model={model['id']}")["results"]
                        if c["state"] == "ready"], 60, message=f"model {name} on the node")
    d = panel.post("/api/deployments/", {"model": model["id"], "node": NODE, "gpus": [0], "preset": "none",
                                         "name": name, "sleep_mode": True})
    row = wait_until(lambda: (r := panel.get(f"/api/deployments/{d['id']}/"))["status"] in ("ready", "failed") and r,
                     240, message=f"{name} ready")
    assert row["status"] == "ready", f"{name}: {row['status_message']}\n{panel.tail()}"
    log = Path(row["log_path"]).read_text(errors="replace")
    line = next(x for x in log.splitlines() if x.startswith("GPU-STAND-IN "))
    return d["id"], json.loads(line[len("GPU-STAND-IN "):])["pid"]


def _verdict(panel: Panel, pk: int, after: int = 0) -> dict:
    return wait_until(lambda: (p := panel.get(f"/api/deployments/{pk}/")["sleep_probe"]) and p["id"] > after
                      and p["verdict"] != "running" and p, 300, interval=0.5, message="the sleep probe's verdict")


def _stop(panel: Panel, pk: int) -> None:
    panel.post(f"/api/deployments/{pk}/stop/")
    wait_until(lambda: panel.get(f"/api/deployments/{pk}/")["status"] in ("stopped", "failed"), 60,
               message="the engine stopped")


def test_the_sleep_probe_records_what_nvidia_smi_shows_and_refuses_a_sleep_that_frees_nothing(gpus, base):
    panel = Panel(base, _stand_in(base))
    smi = None
    try:
        panel.wait_up()
        panel.login()
        wait_until(lambda: (n := panel.find(f"/api/nodes/{NODE}/")) and n["online"] and n["gpus"], 120,
                   message=f"node {NODE} to register")
        good, holder = _deploy(panel, base, "probe-good")
        smi = SmiApps()
        panel.post(f"/api/deployments/{good}/sleep-probe/")
        probe = _verdict(panel, good)
        smi.stop()
        assert probe["verdict"] == "passed", probe
        tried = [r for r in probe["levels"] if r["tried"]]
        assert [r["level"] for r in tried] == [1, 2], probe["levels"]  # the host's RAM holds the stand-in's weights
        for r in tried:
            assert r["gpu_before"]["0"] >= HOLD_GIB * GIB and r["gpu_asleep"]["0"] < GIB, r
            for moment in ("gpu_before", "gpu_asleep", "gpu_after"):
                assert smi.showed(holder, r[moment]["0"]), (r["level"], moment, r[moment]["0"], smi.readings[-3:])
        print(f"\n{gpus[0].name}: sleep probe passed; " + "; ".join(
            f"level {r['level']}: sleep {r['sleep_s']:.2f} s, wake {r['wake_s']:.2f} s, GPU 0 "
            f"{r['gpu_before']['0'] / GIB:.2f} -> {r['gpu_asleep']['0'] / GIB:.2f} -> {r['gpu_after']['0'] / GIB:.2f} GiB, "
            f"host RAM taken {r['ram_taken_bytes'] / GIB:.2f} GiB, answer {'same' if r['answer_same'] else 'changed'}"
            for r in tried) + f" (each figure shown by nvidia-smi among {len(smi.readings)} readings)")
        _stop(panel, good)

        leaky, _ = _deploy(panel, base, "probe-leaky", sleep_leak=True)
        panel.post(f"/api/deployments/{leaky}/sleep/")  # its first sleep: probed first
        probe = _verdict(panel, leaky)
        assert probe["verdict"] == "failed" and "still held" in probe["reason"], probe
        row = wait_until(lambda: (r := panel.get(f"/api/deployments/{leaky}/")) and any(
            "Sleep refused" in e["message"] for e in
            panel.get(f"/api/deployments/{leaky}/events/")["events"]) and r, 60, message="the sleep refused")
        assert row["status"] == "ready"
        refused = panel.http.post(f"/api/deployments/{leaky}/sleep/", json={})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "sleep_probe_failed", refused.text
        print(f"leaky stand-in refused: {probe['reason']}")
        _stop(panel, leaky)
    finally:
        if smi:
            smi.stop()
        panel.stop()
