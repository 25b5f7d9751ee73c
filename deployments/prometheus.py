"""Prometheus metric families for nodes, GPUs, deployments and downloads, built from what the panel
already holds: the rows, and each node's last telemetry sample kept in Redis (plumbing/live/snapshots.py).
Nothing here asks an agent or an engine; a scrape costs a few queries and one Redis round trip.

GPU families are named the Prometheus way (base units: bytes, ratio, hertz) and labelled like
dcgm-exporter (`gpu`, `UUID`, `modelName`) plus `node`; docs/monitoring.md maps each one to its
`DCGM_FI_DEV_*` name and monitoring/dcgm-rules.yml records them under those names.
"""
import time
from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.samples import Sample
from django.conf import settings
from django.db.models import F

from deployments import energy, payloads
from deployments.models import Deployment, DeploymentEvent, Gpu, ModelCopy, Node
from plumbing.live import snapshots

GPU_LABELS = ["node", "gpu", "UUID", "modelName"]
DEPLOYMENT_LABELS = ["deployment", "node", "model"]
# (family, help, key in the telemetry sample, factor to base units)
GPU_FIGURES = [
    ("panel_gpu_memory_used_bytes", "GPU memory in use (DCGM_FI_DEV_FB_USED).", "memory_used", 1),
    ("panel_gpu_memory_free_bytes", "GPU memory free (DCGM_FI_DEV_FB_FREE).", "memory_free", 1),
    ("panel_gpu_memory_total_bytes", "GPU memory in all (DCGM_FI_DEV_FB_TOTAL).", "memory_total", 1),
    ("panel_gpu_utilization_ratio", "Time a kernel ran, 0-1 (DCGM_FI_DEV_GPU_UTIL / 100).", "util_gpu", 0.01),
    ("panel_gpu_memory_utilization_ratio", "Time memory was read or written, 0-1 (DCGM_FI_DEV_MEM_COPY_UTIL / 100).",
     "util_memory", 0.01),
    ("panel_gpu_temperature_celsius", "GPU temperature (DCGM_FI_DEV_GPU_TEMP).", "temperature_c", 1),
    ("panel_gpu_power_watts", "Power draw (DCGM_FI_DEV_POWER_USAGE).", "power_w", 1),
    ("panel_gpu_power_limit_watts", "Power limit (DCGM_FI_DEV_POWER_MGMT_LIMIT).", "power_limit_w", 1),
    ("panel_gpu_sm_clock_hertz", "SM clock (DCGM_FI_DEV_SM_CLOCK, in MHz there).", "sm_clock_mhz", 1e6),
    ("panel_gpu_pcie_link_generation", "Current PCIe link generation (DCGM_FI_DEV_PCIE_LINK_GEN).", "pcie_gen", 1),
    ("panel_gpu_pcie_link_width", "Current PCIe link width in lanes (DCGM_FI_DEV_PCIE_LINK_WIDTH).", "pcie_width", 1),
    ("panel_gpu_ecc_single_bit_volatile_errors", "Corrected ECC errors since the driver loaded (DCGM_FI_DEV_ECC_SBE_VOL_TOTAL).",
     "ecc_sbe_volatile", 1),
    ("panel_gpu_ecc_double_bit_volatile_errors", "Uncorrected ECC errors since the driver loaded (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL).",
     "ecc_dbe_volatile", 1),
]


def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def add_sample(family: GaugeMetricFamily, labels: dict, value) -> None:
    """family.add_metric without its per-sample zip: one labels dict may serve several families
    (a GPU's figures), which controlpanel.metricsview.render then writes once."""
    family.samples.append(Sample(family.name, labels, value, None))


def _model_label(repo_id: str, revision: str) -> str:
    return repo_id if revision == "main" else f"{repo_id}@{revision}"


class FleetCollector:
    """Nodes and their GPUs: the rows for identity, the last sample for the readings. `gpus`:
    gpu_rows() when the caller has them (they change only when an agent registers)."""

    def __init__(self, gpus: dict[int, dict[int, tuple]] | None = None):
        self.gpus = gpus

    @staticmethod
    def gpu_rows() -> dict[int, dict[int, tuple]]:
        """{node id: {GPU index: (UUID, name)}}."""
        gpus: dict[int, dict[int, tuple]] = {}
        for node_id, index, uuid, name in Gpu.objects.values_list("node_id", "index", "uuid", "name"):
            gpus.setdefault(node_id, {})[index] = (uuid, name)
        return gpus

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.time()
        nodes = list(Node.objects.values_list("id", "name", "address", "agent_version", "engine_version", "last_heartbeat",
                                              "heartbeat_seconds", "disk_total", "disk_free", "nvml_error"))
        gpus = self.gpus if self.gpus is not None else self.gpu_rows()
        try:
            samples = snapshots.kept([payloads.node_topic(n[0]) for n in nodes], "sample")
        except redis.RedisError:  # the rows still say something; readings are left out, not made up
            samples = [None] * len(nodes)

        info = gauge("panel_node_info", "A node's address, agent and engine versions, and whether NVML works (value 1).",
                      ["node", "address", "agent_version", "engine_version", "nvml"])
        online = gauge("panel_node_online", "1 while the node's agent heartbeats, else 0.", ["node"])
        age = gauge("panel_node_heartbeat_age_seconds", "Seconds since the agent's last heartbeat.", ["node"])
        disk_free = gauge("panel_node_model_store_free_bytes", "Free space of the node's model store.", ["node"])
        disk_total = gauge("panel_node_model_store_size_bytes", "Size of the node's model store's file system.", ["node"])
        gpu_count = gauge("panel_node_gpus", "NVIDIA GPUs the agent found.", ["node"])
        sampled = gauge("panel_node_last_sample_timestamp_seconds", "Unix time of the node's last telemetry sample.", ["node"])
        ram = gauge("panel_node_memory_available_bytes", "Host RAM available, from the last sample.", ["node"])
        load1 = gauge("panel_node_load1", "Host load average over one minute, from the last sample.", ["node"])
        figures = [(gauge(name, doc, GPU_LABELS), key, factor) for name, doc, key, factor in GPU_FIGURES]
        # 13 figures x 8 GPUs x every node, each scrape: the inner loop is kept to plain appends.
        appends = [(family.samples.append, family.name, key, factor) for family, key, factor in figures]
        for (node_id, name, address, agent_version, engine_version, heartbeat, every, total, free, nvml_error), sample \
                in zip(nodes, samples):
            info.add_metric([name, address, agent_version, engine_version, "unavailable" if nvml_error else "ok"], 1)
            beat_age = now - heartbeat.timestamp() if heartbeat else None
            online.add_metric([name], 1 if beat_age is not None and beat_age < 3 * every else 0)
            if beat_age is not None:
                age.add_metric([name], beat_age)
            disk_free.add_metric([name], free)
            disk_total.add_metric([name], total)
            rows = gpus.get(node_id, {})
            gpu_count.add_metric([name], len(rows))
            if not sample:
                continue
            sampled.add_metric([name], sample["t"])
            host = sample.get("host") or {}
            if host.get("ram_available") is not None:
                ram.add_metric([name], host["ram_available"])
            if host.get("load1") is not None:
                load1.add_metric([name], host["load1"])
            for g in sample.get("gpus") or []:
                uuid, model_name = rows.get(g["index"], (g.get("uuid"), ""))
                labels = {"node": name, "gpu": str(g["index"]), "UUID": uuid or g.get("uuid") or "", "modelName": model_name or ""}
                for append, family_name, key, factor in appends:
                    value = g.get(key)
                    if value is not None:
                        append(Sample(family_name, labels, value * factor if factor != 1 else value, None))
        yield from (info, online, age, disk_free, disk_total, gpu_count, sampled, ram, load1)
        yield from (family for family, _, _ in figures)


class DeploymentCollector:
    """Deployments: state, restarts, load phases, ready since. Node names come from the caller, so
    that what this reads (and a cache of it) does not depend on the node table, which every
    heartbeat writes."""

    def __init__(self, node_names: dict[int, str]):
        self.node_names = node_names

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = list(Deployment.objects.values_list(
            "id", "name", "node_id", "model__repo_id", "model__revision", "status", "restarts", "port",
            "started", "ready_at", "load_percent"))
        gpu_indices: dict[int, list[int]] = {}
        for deployment_id, index in Deployment.gpus.through.objects.values_list("deployment_id", "gpu__index"):
            gpu_indices.setdefault(deployment_id, []).append(index)
        phases: dict[int, dict[str, float]] = {}
        # Each step's latest run: a restart or a redeploy writes the steps again.
        for deployment_id, step, started, ended in DeploymentEvent.objects.filter(ended__isnull=False).exclude(ended=F("started")).order_by(
                "started", "id").values_list("deployment_id", "step", "started", "ended"):
            phases.setdefault(deployment_id, {})[step] = (ended - started).total_seconds()

        info = gauge("panel_deployment_info", "A deployment's GPUs and port (value 1).", DEPLOYMENT_LABELS + ["gpus", "port"])
        state = gauge("panel_deployment_state", "1 for the deployment's current state, 0 for the others.",
                       DEPLOYMENT_LABELS + ["state"])
        restarts = gauge("panel_deployment_restarts", "Automatic restarts after crashes.", DEPLOYMENT_LABELS)
        phase = gauge("panel_deployment_load_phase_seconds",
                       "How long each step of the deployment's timeline last took (model, gpu_memory, launch, load, "
                       "smoke_test, ...).", DEPLOYMENT_LABELS + ["phase"])
        load = gauge("panel_deployment_load_seconds", "From the engine's start to ready, for the last start.", DEPLOYMENT_LABELS)
        ready = gauge("panel_deployment_ready_since_timestamp_seconds", "Unix time the engine became ready, while it is.",
                       DEPLOYMENT_LABELS)
        progress = gauge("panel_deployment_load_progress_ratio", "Load progress while loading, 0-1.", DEPLOYMENT_LABELS)
        used = energy.totals()
        joules = CounterMetricFamily("panel_deployment_energy_joules", "What the deployment's GPUs drew while it was up "
                                     "(their energy counters, read by the node agent).", labels=DEPLOYMENT_LABELS)
        idle = CounterMetricFamily("panel_deployment_idle_energy_joules", "Of it, while the engine had nothing running "
                                   "or waiting.", labels=DEPLOYMENT_LABELS)
        tokens = CounterMetricFamily("panel_deployment_energy_output_tokens", "Output tokens the engine counted over "
                                     "the same readings (joules per token: the rates' ratio).", labels=DEPLOYMENT_LABELS)
        statuses = list(Deployment.Status.values)
        for (pk, name, node_id, repo_id, revision, status, restart_count, port, started, ready_at, percent) in rows:
            labels = [name, self.node_names.get(node_id, ""), _model_label(repo_id, revision)]
            info.add_metric(labels + [",".join(map(str, sorted(gpu_indices.get(pk, [])))), str(port)], 1)
            for s in statuses:
                state.add_metric(labels + [s], 1 if s == status else 0)
            restarts.add_metric(labels, restart_count)
            for step, seconds in phases.get(pk, {}).items():
                phase.add_metric(labels + [step], seconds)
            if started and ready_at and ready_at >= started:
                load.add_metric(labels, (ready_at - started).total_seconds())
            if status == Deployment.Status.READY and ready_at:
                ready.add_metric(labels, ready_at.timestamp())
            if status == Deployment.Status.LOADING and percent is not None:
                progress.add_metric(labels, percent / 100)
            if pk in used:
                joules.add_metric(labels, used[pk]["joules"])
                idle.add_metric(labels, used[pk]["idle_joules"])
                tokens.add_metric(labels, used[pk]["output_tokens"])
        yield from (info, state, restarts, phase, load, ready, progress, joules, idle, tokens)


class DownloadCollector:
    """Model copies on nodes: state, bytes done and in all, rate (node names from the caller)."""

    def __init__(self, node_names: dict[int, str]):
        self.node_names = node_names

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["node", "model"]
        state = gauge("panel_download_state", "1 for the model copy's current state, 0 for the others.", labels + ["state"])
        done = gauge("panel_download_done_bytes", "Bytes of the model on the node so far.", labels)
        total = gauge("panel_download_total_bytes", "Bytes of the model in all.", labels)
        rate = gauge("panel_download_rate_bytes_per_second", "Recent download rate.", labels)
        states = list(ModelCopy.State.values)
        for node_id, repo_id, revision, current, bytes_done, bytes_total, bytes_per_s in ModelCopy.objects.values_list(
                "node_id", "model__repo_id", "model__revision", "state", "bytes_done", "bytes_total", "rate"):
            names = [self.node_names.get(node_id, ""), _model_label(repo_id, revision)]
            for s in states:
                state.add_metric(names + [s], 1 if s == current else 0)
            done.add_metric(names, bytes_done)
            total.add_metric(names, bytes_total)
            rate.add_metric(names, bytes_per_s if current == ModelCopy.State.DOWNLOADING else 0)
        yield from (state, done, total, rate)


def engine_scrape_targets() -> list[dict]:
    """Prometheus HTTP service discovery: one target group per ready engine, its /metrics through its node's
    gateway (engines listen on loopback; the gateway answers `/engines/<id>/metrics` to the internal
    scrape key, deployments/scrapekey.py), labelled with node, deployment, model and GPUs."""
    groups = []
    for d in Deployment.objects.filter(status=Deployment.Status.READY).select_related("node", "model").prefetch_related(
            "gpus").order_by("name"):
        groups.append({
            "targets": [f"{d.node.address or '127.0.0.1'}:{d.node.gateway_port or settings.GATEWAY_PORT}"],
            "labels": {"__metrics_path__": f"/engines/{d.pk}/metrics",
                       "__scheme__": "https" if settings.GATEWAY_TLS_CERT else "http", "node": d.node.name, "deployment": d.name,
                       "model": str(d.model), "gpus": ",".join(map(str, d.gpu_indices))},
        })
    return groups
