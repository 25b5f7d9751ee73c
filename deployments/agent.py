"""The node agent's own loop: register, sample the host every second, heartbeat.

One iteration is `Agent.tick()`, so tests call it directly; `loop()` only repeats it.
"""
import logging
import threading
import time

from django.db import close_old_connections

from deployments import services
from deployments.host import disk, gpu

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, *, name: str, model_store: str, address: str, version: str,
                 sample_seconds: float = 1.0, heartbeat_seconds: float = 5.0):
        self.name = name
        self.model_store = model_store
        self.address = address
        self.version = version
        self.sample_seconds = sample_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.node_id = None
        self.nvml_error = ""
        self._last_heartbeat = 0.0

    def register(self) -> None:
        """Create or update this node and its GPUs."""
        try:
            gpus = gpu.inventory()
            self.nvml_error = ""
        except gpu.NvmlUnavailable as exc:
            gpus, self.nvml_error = [], str(exc)
        node = services.node_register(
            name=self.name, address=self.address, agent_version=self.version, model_store=self.model_store,
            heartbeat_seconds=self.heartbeat_seconds, gpus=gpus, nvml_error=self.nvml_error,
        )
        self.node_id = node.pk
        self.gpu_count = len(gpus)

    def describe(self) -> str:
        return self.nvml_error or f"{self.gpu_count} GPU(s)"

    def tick(self, now: float | None = None) -> dict:
        """Take one sample of the host, publish it, and heartbeat when due; returns the sample."""
        now = time.monotonic() if now is None else now
        sample = self.sample()
        services.node_sample_record(self.node_id, sample)
        if now - self._last_heartbeat >= self.heartbeat_seconds:
            services.node_heartbeat(self.node_id, disk_total=sample["disk"]["total"], disk_free=sample["disk"]["free"])
            self._last_heartbeat = now
        return sample

    def sample(self) -> dict:
        """GPUs, disk of the model store and host load, as one JSON-able dict."""
        taken = time.time()
        gpus = []
        if not self.nvml_error:
            try:
                gpus = [_asdict(s) for s in gpu.sample()]
            except gpu.NvmlUnavailable as exc:
                self.nvml_error = str(exc)
        usage = disk.disk_usage(self.model_store)
        host = disk.host_stats()
        return {
            "t": taken,
            "gpus": gpus,
            "nvml_error": self.nvml_error,
            "disk": {"total": usage.total, "free": usage.free, "used": usage.used},
            "host": {"ram_total": host.ram_total, "ram_available": host.ram_available, "load1": host.load1},
        }

    def loop(self, stop: threading.Event) -> None:
        """Tick every `sample_seconds` until stopped; one failing tick never stops the loop."""
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the sampler must outlive any one bad sample
                log.exception("node %s: sample failed", self.name)
                close_old_connections()
            next_at += self.sample_seconds
            stop.wait(max(0.0, next_at - time.monotonic()))
            if time.monotonic() - next_at > self.sample_seconds:  # fell behind: don't burst to catch up
                next_at = time.monotonic()


def _asdict(sample) -> dict:
    from dataclasses import asdict

    return asdict(sample)
