"""The start causes read off the real engine's words: vLLM 0.32's own KV-cache checks (vllm/v1/core/kv_cache_utils.py)
raise their errors in the engine's Python, and deployments/host/startcauses.py names each with its fix. (The other
causes come from CUDA, NCCL and GPU platforms a CPU engine never reaches: tests/host/test_startcauses.py holds them
with their format strings rendered.)"""
import json
import subprocess

import pytest

from deployments.host import startcauses
from tests.conftest import ENGINE_VENV

pytestmark = pytest.mark.e2e
SCRIPT = """
import json
from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory
said = []
for available in (0, 11 * 2**30):
    try:
        _check_enough_kv_cache_memory(available, lambda: 30 * 2**30, 262144, lambda memory: 98160)
    except ValueError as exc:
        said.append(f"(EngineCore_DP0 pid=5812) ERROR 12-05 13:27:56 [core.py:1512] ValueError: {exc}")
print(json.dumps(said))
"""


def test_vllms_own_kv_cache_errors_are_named_with_their_fix():
    out = subprocess.run([str(ENGINE_VENV / "bin" / "python"), "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    no_room, too_short = json.loads(out.stdout.splitlines()[-1])
    assert startcauses.advise([no_room], {"gpu-memory-utilization": 0.9}).fix == {"gpu-memory-utilization": 0.95}
    cause = startcauses.advise([too_short])
    assert (cause.kind, cause.fix) == ("kv_too_small", {"max-model-len": 98160}), too_short
