"""How the pages say why a node has no GPU: NVML's reason in words, once (the fleet card said
"no NVIDIA GPU on this node" twice, the second time inside NVML's raw error)."""
from django import template

register = template.Library()

PREFIX = "no NVIDIA GPU on this node: "  # deployments.host.gpu.NvmlUnavailable's message
# pynvml's error texts (NVMLError.__str__) for a host without a usable driver, in a user's words.
REASONS = {
    "NVML Shared Library Not Found": "the NVIDIA driver is not installed (no NVML library found)",
    "Driver Not Loaded": "the NVIDIA driver is installed but not loaded",
    "Insufficient Permissions": "the agent may not open the GPUs (permission denied)",
    "Function Not Found": "the NVIDIA driver is older than NVML needs",
    "RM has detected an NVML/RM version mismatch.": "the NVIDIA driver and its NVML library are of different versions "
                                                    "(reboot after a driver update)",
}


@register.filter
def no_gpu_reason(nvml_error: str) -> str:
    """The agent's NVML error, without the repeated 'no NVIDIA GPU' and with NVML's terms explained."""
    reason = (nvml_error or "").strip().removeprefix(PREFIX).strip()
    return REASONS.get(reason, reason)
