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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a host with an NVIDIA GPU nothing here may be skipped: a skip there means a missing part
    (NVML, torch, free memory) and would pass unseen. The command in docs/testing.md (--confcutdir=tests/gpu)
    does not load tests/conftest.py, so this folder carries its own rule."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and shutil.which("nvidia-smi") and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped on a GPU host, where nothing may be skipped: {report.longrepr}"
