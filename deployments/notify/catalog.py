"""The events worth telling: each kind's label, severity and alert group. Plain data, no Django imports.

A kind in a `group` is a condition: it fires, later events of the same group for the same deployment or node
are folded into it (a restart loop is one message), and one resolve message ends it. A kind without a group
is a moment (ready, a finished download): one message each."""
from dataclasses import dataclass

INFO, WARNING, ERROR, CRITICAL = "info", "warning", "error", "critical"
SEVERITIES = (INFO, WARNING, ERROR, CRITICAL)


@dataclass(frozen=True)
class Kind:
    name: str
    label: str
    severity: str
    group: str = ""  # conditions of one group share one alert per subject


KINDS = {k.name: k for k in (
    Kind("ready", "Deployment ready", INFO),
    Kind("failed", "Deployment failed", ERROR, "failed"),
    Kind("stalled", "Load stalled", ERROR, "failed"),
    Kind("displaced", "Stopped for another deployment", WARNING),
    Kind("crashed", "Engine crashed", ERROR, "down"),
    Kind("auto_restarted", "Auto-restarted", WARNING, "down"),
    Kind("restart_loop", "Restarting in a loop", CRITICAL, "down"),
    Kind("download_finished", "Download finished", INFO),
    Kind("download_failed", "Download failed", ERROR),
    Kind("disk_low", "Disk below threshold", WARNING, "disk"),
    Kind("node_offline", "Node offline", ERROR, "offline"),
    Kind("engine_exposed", "Engine reachable without a key", CRITICAL, "exposure"),
    Kind("gpu_ecc", "GPU ECC errors", ERROR, "ecc"),
    Kind("gpu_thermal", "GPU temperature high", WARNING, "thermal"),
    Kind("slo_breached", "SLO breached", WARNING, "slo"),
    Kind("benchmark_finished", "Benchmark finished", INFO),
    Kind("study_finished", "Study finished", INFO),
    Kind("test", "Test message", INFO),
)}
# What a user can subscribe to (a test message goes to its channel only).
SUBSCRIBABLE = tuple(k for k in KINDS if k != "test")
CHOICES = [(k.name, k.label) for k in KINDS.values()]
