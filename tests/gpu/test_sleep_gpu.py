"""Sleep mode on a real NVIDIA GPU, through the whole panel (tests/sleeppanel.py: the launcher, its agent, the REST
API): a swap pair of GPU stand-ins (tests/gpu/standin_vllm.py, whose EngineCore child holds real GPU memory and
frees it on sleep, takes it again on wake) on GPU 0. Deployed asleep, B holds nothing while A holds its weights;
each swap moves the memory from one to the other as NVML sees it, and the panel's part of a swap is printed
beside the engine's own calls (perf/swap.py measures it over more swaps)."""
import os
import tempfile
from pathlib import Path

import pytest

from tests.sleeppanel import GIB, HOLD_GIB, SwapPair

pytestmark = pytest.mark.gpu
ASLEEP_MAX = 1 * GIB  # a CUDA context and the allocator's crumbs: what an engine asleep keeps on the GPU


def test_a_swap_moves_the_gpu_memory_from_one_deployment_to_the_other(gpus):
    if os.geteuid() != 0:
        pytest.fail("the agent starts engines as another user only as root (the device machine's commands run as root)")
    base = Path(tempfile.mkdtemp(prefix="gpu-sleep-"))
    base.chmod(0o755)
    pair = SwapPair(base, on_gpu=True)
    try:
        pair.start()
        held = pair.held()
        assert held["a"] >= HOLD_GIB * GIB and held["b"] <= ASLEEP_MAX, held  # B was loaded, then put to sleep
        swaps = [pair.swap("a", "b"), pair.swap("b", "a")]
        for s in swaps:
            assert s.held[s.target] >= HOLD_GIB * GIB and s.held[s.source] <= ASLEEP_MAX, (s.source, s.target, s.held)
        print("\n" + "; ".join(f"swap {s.source} -> {s.target}: {s.total_s:.2f} s (engine's sleep + wake calls "
                               f"{s.engine_s:.2f} s, the panel's part {s.overhead_s:.2f} s), NVML after: "
                               + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in sorted(s.held.items()))
                               for s in swaps) + f" on {gpus[0].name}")
    finally:
        pair.stop()
