"""The node agent's own loop: register, sample the host every second, heartbeat.

One iteration is `Agent.tick()`, so tests call it directly; `loop()` only repeats it.
"""
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import asdict

import redis
from django.conf import settings
from django.db import close_old_connections

from deployments import agenthooks, history, loads
from deployments.host import disk, firewall, gpu, osuser
from deployments.node import guards, reconcile, watch
from deployments.services import doctor, nodes, repos

log = logging.getLogger(__name__)
ENGINES_REFRESH_S = 5.0  # how often the agent re-reads which process groups belong to deployments
WATCH_EVERY_S = 2.0  # crash detection of ready engines (their /health is asked every 5 s)
STUDY_STEP_S = 0.5  # how often tuning studies are stepped: bounds the panel's overhead between a study's steps


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
        self._engines: dict[int, dict] = {}
        self._engines_at = -1e9
        self.minutes = history.MinuteAggregator()
        self._watch_state: dict = {}
        self._metrics_state: dict = {}
        self._watched_at = -1e9
        self._reconciled = False
        # None until the first reading: it is always stored, whatever the previous agent left on the node's row.
        self._foreign: list[dict] | None = None
        self._listeners: list[dict] | None = None
        self._described: dict = {}  # what guards.listeners_of read of each listener, kept between its calls
        self._net: tuple[float, int, int] | None = None  # (time, sent, received) of the previous sample
        self._engine_present: bool | None = None  # the engine's program was there at the last heartbeat
        self._doctor_at: float | None = None  # the first tick's clock: the host checks ran at start (_report_engine)

    def register(self) -> None:
        """Create or update this node and its GPUs."""
        try:
            gpus = gpu.inventory()
            self.nvml_error = ""
        except gpu.NvmlUnavailable as exc:
            gpus, self.nvml_error = [], str(exc)
        node = nodes.node_register(
            name=self.name, address=self.address, agent_version=self.version, model_store=self.model_store,
            heartbeat_seconds=self.heartbeat_seconds, gpus=gpus, nvml_error=self.nvml_error,
            agent_host=socket.gethostname(), agent_pid=os.getpid(), engine_user=self._engine_user(),
        )
        self.node_id = node.pk
        self.gpu_count = len(gpus)
        self._reconcile()
        # `vllm serve --help=all` takes seconds: learn the engine's flags without delaying the start.
        threading.Thread(target=self._report_engine, name="engine-report", daemon=True).start()

    def _engine_user(self) -> dict:
        """Who engines run as (created when missing), with var/ closed to it; what the node page shows."""
        from django.conf import settings

        try:
            user = osuser.current()
        except osuser.EngineUserError as exc:
            log.error("node %s: %s", self.name, exc)
            return {"error": str(exc), "describe": f"unknown: {exc}"}
        osuser.protect(settings.VAR_DIR, user)
        return user.facts()

    def _reconcile(self) -> None:
        """Resume downloads and settle deployments left by a previous agent; it queues tasks, so
        with Redis away it is retried from the loop instead of keeping the agent from heartbeating."""
        from deployments.models import Node

        try:
            node = Node.objects.get(pk=self.node_id)
            resumed = repos.model_copies_resume(node)
            if resumed:
                log.info("node %s: resuming %d unfinished download(s)", self.name, len(resumed))
            report = reconcile.deployments_reconcile(node)
            if any(report.values()):
                log.info("node %s: deployments after restart: %s", self.name, report)
            self._sweep_firewall()
            self._reconciled = True
        except Exception:  # noqa: BLE001 - retried next tick
            log.exception("node %s: settling what the last agent left failed; retrying", self.name)
            close_old_connections()

    def _sweep_firewall(self) -> None:
        """Drop the firewall rules of engine groups that ended while no agent watched (host/firewall.py)."""
        try:
            swept = firewall.sweep()
        except firewall.FirewallError as exc:
            log.warning("node %s: cannot clean the engines' firewall rules: %s", self.name, exc)
            return
        if swept:
            log.info("node %s: firewall rules of %d ended engine group(s) removed", self.name, len(swept))

    def _report_engine(self) -> None:
        try:
            reconcile.node_engine_report(self.node_id)
            loads.node_measure_disk_once(self.node_id)  # load time: the store's read rate, once
            doctor.node_doctor_run(self.node_id, self.model_store)  # the host doctor: host checks, once at start
        finally:
            close_old_connections()

    def _doctor(self) -> None:
        try:
            doctor.node_doctor_run(self.node_id, self.model_store)  # never raises
        finally:
            close_old_connections()

    def describe(self) -> str:
        return self.nvml_error or f"{self.gpu_count} GPU(s)"

    def _engine_moved(self) -> bool:
        """Whether the engine's program appeared or went since the last look (the first look only notes it: the start
        reports the engine anyway). The node's engine row, the deploy form and the host checks said "no engine" until
        the agent restarted."""
        present = shutil.which(settings.VLLM_BIN) is not None
        moved = self._engine_present is not None and present != self._engine_present
        self._engine_present = present
        return moved

    def tick(self, now: float | None = None) -> dict:
        """Take one sample of the host, publish it, and heartbeat when due; returns the sample."""
        now = time.monotonic() if now is None else now
        sample = self.sample()
        if now - self._engines_at >= ENGINES_REFRESH_S:  # what the sample's GPU processes belong to
            self._engines, self._engines_at = nodes.node_engines(self.node_id), now
            self._foreign = guards.node_foreign_record(self.node_id, self._foreign)
            self._listeners = guards.node_listeners_record(self.node_id, self._listeners, self._described)
            repos.model_copies_stalled_resume(self.node_id)
        # The sample first: the crash watch below may wait seconds on an engine's /health, and browsers
        # would see the sample that much later. Heartbeat and crash watch must not depend on Redis.
        try:
            nodes.node_sample_record(self.node_id, sample, self._engines, self.sample_seconds)
        except (redis.RedisError, OSError) as exc:
            log.warning("node %s: sample not recorded: %s", self.name, exc)
        if now - self._last_heartbeat >= self.heartbeat_seconds:
            nodes.node_heartbeat(self.node_id, disk_total=sample["disk"]["total"], disk_free=sample["disk"]["free"],
                                 ram_total=sample["host"].get("ram_total"), cpu_count=sample["host"].get("cpu_count"))
            self._last_heartbeat = now
            if self._engine_moved():  # scripts/install-engine after the start, or a venv removed: say so now
                threading.Thread(target=self._report_engine, name="engine-report", daemon=True).start()
        self._doctor_at = now if self._doctor_at is None else self._doctor_at
        if now - self._doctor_at >= doctor.DOCTOR_EVERY_S:  # host checks again every 10 min, off the sampler
            self._doctor_at = now
            threading.Thread(target=self._doctor, name="doctor", daemon=True).start()
        if not self._reconciled:
            self._reconcile()
        if now - self._watched_at >= WATCH_EVERY_S:
            self._watched_at = now
            watch.deployments_watch(self.node_id, self._watch_state)
            watch.deployments_metrics(self.node_id, self._metrics_state)
        closed = self.minutes.add(sample)
        if closed:
            nodes.node_minute_record(self.node_id, closed)
        return sample

    def drive_studies(self) -> int:
        """One step of each tuning study on this node's deployments: the study's state lives in
        the database, so the next agent continues where a killed one stopped. The benchmarks app registers
        its stepper (agenthooks.STUDY_STEPPERS) when it loads: it depends on deployments, never the other way round."""
        return sum(drive(self.node_id) or 0 for drive in agenthooks.STUDY_STEPPERS)

    def study_loop(self, stop: threading.Event, every_s: float = STUDY_STEP_S) -> None:
        """Step studies every `every_s` in a thread of their own, so a slow step never delays a sample."""
        while not stop.is_set():
            try:
                self.drive_studies()
            except Exception:  # noqa: BLE001 - retried next time
                log.exception("node %s: driving studies failed", self.name)
            finally:
                close_old_connections()
            stop.wait(every_s)

    def sample(self) -> dict:
        """GPUs, disk of the model store, and the host's CPU, RAM, load and network rates, as one JSON-able dict."""
        taken = time.time()
        gpus = []
        if not self.nvml_error:
            try:
                gpus = [_asdict(s) for s in gpu.sample()]
            except gpu.NvmlUnavailable as exc:
                self.nvml_error = str(exc)
        usage = disk.disk_usage(self.model_store)
        host = disk.host_stats()
        rx = tx = None
        if self._net and taken > self._net[0]:
            elapsed = taken - self._net[0]
            tx = max(0.0, (host.net_sent - self._net[1]) / elapsed)
            rx = max(0.0, (host.net_recv - self._net[2]) / elapsed)
        self._net = (taken, host.net_sent, host.net_recv)
        return {
            "t": taken,
            "gpus": gpus,
            "nvml_error": self.nvml_error,
            "disk": {"total": usage.total, "free": usage.free, "used": usage.used},
            "host": {"ram_total": host.ram_total, "ram_available": host.ram_available, "load1": host.load1,
                     "cpu_count": host.cpu_count, "cpu_percent": host.cpu_percent, "net_rx_bps": rx, "net_tx_bps": tx},
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
    data = asdict(sample)
    for proc in data["processes"] or []:
        proc["pgid"] = _pgid(proc["pid"])
    return data


def _pgid(pid: int) -> int | None:
    """Process group of a GPU process: engines run in their own group, so it names the engine."""
    try:
        return os.getpgid(pid)
    except OSError:  # gone, or in another PID namespace
        return None
