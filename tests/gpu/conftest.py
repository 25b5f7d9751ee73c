"""Real-GPU checks: skipped on a machine without an NVIDIA GPU. No Django here, on purpose."""

import shutil

import pytest

from deployments.host import gpu


@pytest.fixture(scope="session")
def gpus():
    """The host's GPUs, or a skip saying why there are none."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no NVIDIA GPU: nvidia-smi not found")
    try:
        found = gpu.inventory()
    except gpu.NvmlUnavailable as exc:
        pytest.skip(str(exc))
    if not found:
        pytest.skip("no NVIDIA GPU: NVML lists none")
    return found


@pytest.fixture(autouse=True)
def _needs_gpu(gpus):
    """Every test in this folder needs a GPU."""
