"""A swap pair on the whole panel (panelctl.launcher: web, workers, node agent, embedded Redis, SQLite), driven
through the REST API as a user's script would: deployment A serving and B started asleep on the same GPU (the whole
host on a node without GPUs), then swaps back and forth, each timed from the request to the target answering
"ready", beside the engine's own sleep and wake calls as the agent timed them. Used by perf/swap.py and
tests/gpu/test_sleep_gpu.py; no Django in this process.

The engine is an engine double speaking vLLM's sleep endpoints: on a host with an NVIDIA GPU the GPU stand-in
(tests/gpu/standin_vllm.py, whose EngineCore child frees and re-allocates real GPU memory on sleep and wake), else
the CPU fake (tests/faults/fakevllm/vllm)."""
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from deployments.host import gpu
from tests.conftest import ROOT, wait_until
from tests.gpu.test_whole_panel_gpu import HOLD_GIB, NODE, Panel, _model, _stand_in

GIB = 1 << 30
__all__ = ["GIB", "HOLD_GIB", "Swap", "SwapPair"]


def cpu_fake(base: Path) -> Path:
    """The CPU fake as `vllm` (stdlib only: the system's python3 runs it), in a folder the engine user can read."""
    engine = base / "engine"
    engine.mkdir(mode=0o755)
    vllm = engine / "vllm"
    shutil.copy(ROOT / "tests" / "faults" / "fakevllm" / "vllm", vllm)
    vllm.chmod(0o755)
    for extra in ("fakeproto.py", "serve-flags.txt"):  # the fake's own files, beside it
        shutil.copy(ROOT / "tests" / "faults" / "fakevllm" / extra, engine / extra)
        (engine / extra).chmod(0o644)
    return vllm


@dataclass
class Swap:
    source: str
    target: str
    total_s: float           # the swap request sent -> the API shows the target ready
    engine_s: float          # the engine's own sleep call (source) + wake call (target), as the agent timed them
    agent_s: float           # the agent's whole swap (its "swap" step)
    held: dict = field(default_factory=dict)  # NVML after it: {name: bytes its EngineCore holds on GPU 0}

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.engine_s


class SwapPair:
    """The panel with a swap pair deployed on GPU 0 (or the CPU host): A serving, B asleep."""

    def __init__(self, base: Path, on_gpu: bool):
        self.base, self.on_gpu = base, on_gpu
        self.panel = Panel(base, _stand_in(base) if on_gpu else cpu_fake(base))
        self.ids: dict[str, int] = {}
        self.holders: dict[str, int] = {}

    def start(self) -> None:
        panel = self.panel
        panel.wait_up()
        panel.login()
        wait_until(lambda: (n := panel.find(f"/api/nodes/{NODE}/")) and n["online"] and n["engine_version"]
                   and (n["gpus"] or not self.on_gpu), 120, message=f"node {NODE} to register")
        gpus = [0] if self.on_gpu else []
        for name, asleep in (("a", False), ("b", True)):
            model = panel.post("/api/models/", {"node": NODE, "local_path": str(_model(self.base, [], f"swap-{name}", weights_mb=64))})
            wait_until(lambda: [c for c in panel.get(f"/api/copies/?node={NODE}&model={model['id']}")["results"]
                                if c["state"] == "ready"], 60, message=f"model {name} on the node")
            d = panel.post("/api/deployments/", {"model": model["id"], "node": NODE, "gpus": gpus, "preset": "none",
                                                 "name": f"swap-{name}", "sleep_mode": True, "start_asleep": asleep})
            self.ids[name] = d["id"]
            want = "sleeping" if asleep else "ready"
            row = self.settle(name, {want, "failed", "stopped"}, 240)
            assert row["status"] == want, f"{name}: {row['status']} {row['status_message']}\n{self.panel.tail()}"
        self.settle("a", {"ready"}, 60)  # woken again after B went to sleep
        for name, pk in self.ids.items():
            log = Path(self.panel.get(f"/api/deployments/{pk}/")["log_path"]).read_text(errors="replace")
            line = next((x for x in log.splitlines() if x.startswith("GPU-STAND-IN ")), None)
            if line:
                self.holders[name] = json.loads(line[len("GPU-STAND-IN "):])["pid"]

    def settle(self, name: str, states: set, timeout: float) -> dict:
        pk = self.ids[name]
        return wait_until(lambda: (row := self.panel.get(f"/api/deployments/{pk}/"))["status"] in states and row,
                          timeout, interval=0.02, message=f"{name} to be {'/'.join(sorted(states))}")

    def held(self) -> dict[str, int]:
        if not self.on_gpu:
            return {}
        procs = gpu.sample([0])[0].processes or []
        return {name: sum(p.used_memory or 0 for p in procs if p.pid == pid) for name, pid in self.holders.items()}

    def swap(self, source: str, target: str) -> Swap:
        """One swap through the API, timed here: request -> the target's events long poll shows it ready."""
        pk = self.ids[target]
        state = self.panel.get(f"/api/deployments/{pk}/events/")["state"]
        started = time.monotonic()
        self.panel.post(f"/api/deployments/{self.ids[source]}/swap/", {"to": pk})
        while True:
            answer = self.panel.get(f"/api/deployments/{pk}/events/?state={state}&wait=20")
            state = answer["state"]
            if answer["status"] == "ready":
                break
            assert time.monotonic() - started < 120, f"swap {source} -> {target}: {answer['status']} {answer['events'][-3:]}"
        total = time.monotonic() - started
        slept = self._last(source, "sleep")
        woke = self._last(target, "wake")
        agent = wait_until(lambda: self._last(target, "swap", "seconds"), 10, message="the swap's step")
        return Swap(source, target, total, slept["data"]["engine_s"] + woke["data"]["engine_s"],
                    agent["data"]["seconds"], self.held())

    def _last(self, name: str, step: str, key: str = "engine_s") -> dict | None:
        events = self.panel.get(f"/api/deployments/{self.ids[name]}/events/")["events"]
        return next((e for e in reversed(events) if e["step"] == step and key in (e.get("data") or {})), None)

    def stop(self) -> None:
        try:
            for pk in self.ids.values():
                answer = self.panel.http.post(f"/api/deployments/{pk}/stop/", json={})
                if answer.status_code == 202:
                    wait_until(lambda pk=pk: self.panel.get(f"/api/deployments/{pk}/")["status"] in ("stopped", "failed"),
                               60, message="the engine stopped")
        finally:
            self.panel.stop()
            shutil.rmtree(self.base, ignore_errors=True)
