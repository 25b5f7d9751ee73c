"""Hosts: nodes running a node agent, their GPUs, and their per-minute figures."""
from datetime import timedelta

from django.db import models
from django.utils import timezone



class Node(models.Model):
    """A GPU host running a node agent that consumes the Celery queue `node.<name>`."""

    name = models.SlugField(max_length=64, unique=True)
    address = models.CharField(max_length=255, blank=True, help_text="Host name or IP the engines listen on.")
    agent_version = models.CharField(max_length=64, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    heartbeat_seconds = models.FloatField(default=5.0)
    model_store = models.CharField(max_length=1024, blank=True)
    disk_total = models.BigIntegerField(default=0)
    disk_free = models.BigIntegerField(default=0)
    ram_total = models.BigIntegerField(default=0, help_text="Host RAM in bytes (what a CPU engine holds weights in).")
    cpu_count = models.PositiveIntegerField(default=0, help_text="Logical CPUs of the host.")
    nvml_error = models.CharField(max_length=255, blank=True, help_text="Why NVML is unavailable, if it is.")
    engine_version = models.CharField(max_length=64, blank=True)
    engine_flags = models.JSONField(default=list, blank=True, help_text="Flags the node's `vllm serve` accepts.")
    engine_modules = models.JSONField(default=dict, blank=True,
                                      help_text="The engine's Python and which optional packages a flag may need it "
                                                "has (host/enginemodules.report): {python, present}; {} not known.")
    engine_error = models.CharField(max_length=500, blank=True, help_text="Why the engine could not be inspected.")
    systemd = models.BooleanField(default=False, help_text="The agent can install systemd units here.")
    engine_user = models.JSONField(default=dict, blank=True,
                                   help_text="Who the agent runs engines as (host/osuser.EngineUser.facts()).")
    agent_host = models.CharField(max_length=255, blank=True, help_text="Host name of the agent that heartbeats.")
    agent_pid = models.IntegerField(null=True, blank=True, help_text="PID of the agent that heartbeats.")
    foreign_processes = models.JSONField(default=list, blank=True,
                                         help_text="Processes on the GPUs the panel did not start, as the agent last saw them.")
    listeners = models.JSONField(default=list, blank=True,
                                 help_text="Who listens on which TCP port of the host, as the agent last saw it: "
                                           "[{port, pid, user, command, deployment}].")
    disk_read = models.JSONField(default=dict, blank=True,
                                 help_text="The model store's sequential read rate: {bps, bytes, cold, at}.")
    gateway_port = models.PositiveIntegerField(null=True, blank=True,
                                               help_text="The port the node's gateway listens on, as its gateway reports it.")
    host_checks = models.JSONField(default=dict, blank=True,
                                   help_text="The host doctor's last report: {at, checks: [{name, status, summary, fix, data}], "
                                             "topology, nccl_presets} (deployments/host/doctor.py).")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def queue(self) -> str:
        return f"node.{self.name}"

    @property
    def online(self) -> bool:
        return self.is_online(self.last_heartbeat, self.heartbeat_seconds)

    @staticmethod
    def is_online(last_heartbeat, heartbeat_seconds: float, now=None) -> bool:
        """Online while the last heartbeat is younger than three heartbeat intervals."""
        if last_heartbeat is None:
            return False
        return (now or timezone.now()) - last_heartbeat < timedelta(seconds=3 * heartbeat_seconds)

    @property
    def has_gpu(self) -> bool:
        return not self.nvml_error


class Gpu(models.Model):
    """One NVIDIA GPU of a node, as NVML reports it."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=96, blank=True)
    name = models.CharField(max_length=128, blank=True)
    memory_total = models.BigIntegerField(default=0)
    compute_capability = models.CharField(max_length=16, blank=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node")]

    def __str__(self):
        return f"{self.node.name}:{self.index} {self.name}"


class NodeMetric(models.Model):
    """One minute of a node's telemetry (averages and peaks); the last hour at 1 s lives in Redis."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="metrics")
    t = models.DateTimeField(help_text="Start of the minute.")
    data = models.JSONField(help_text='{"gpus": [{"index", "memory_used", "memory_used_max", "util_gpu", ...}], "disk_free", ...}')

    class Meta:
        ordering = ["node", "t"]
        constraints = [models.UniqueConstraint(fields=["node", "t"], name="metric_unique_minute")]

    def __str__(self):
        return f"{self.node} @ {self.t:%Y-%m-%d %H:%M}"
