"""The start causes read off the real engine's words: vLLM 0.32's own KV-cache checks (vllm/v1/core/kv_cache_utils.py)
raise their errors in the engine's Python, and deployments/host/startcauses.py names each with its fix. (The other
causes come from CUDA, NCCL and GPU platforms a CPU engine never reaches: tests/host/test_startcauses.py holds them
with their format strings rendered.)"""
import json
import subprocess

import pytest

from deployments.host import startcauses
from tests.conftest import ENGINE_VENV
from tests.host.test_startcauses import KV_HINT, OOM

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


def test_every_fix_is_a_flag_the_real_engine_parses_to_the_value_advised():
    """The changes the advisor names are flags `vllm serve` takes, parsed by its own parser to the values advised
    (vLLM's message says --kv-cache-memory; the flag is --kv-cache-memory-bytes)."""
    fixes = [startcauses.advise([KV_HINT, OOM]).fix, startcauses.advise([OOM], {"gpu-memory-utilization": 0.9}).fix,
             startcauses.advise(["ValueError: To serve at least one request with the model's max seq len (4096), (1.0 GiB "
                                 "KV cache is needed, which is larger than the available KV cache memory (0.5 GiB). Based "
                                 "on the available memory, the estimated maximum model length is 2048."]).fix]
    script = (
        "import json, sys\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "out = []\n"
        "for fix in json.load(sys.stdin):\n"
        "    parser = FlexibleArgumentParser()\n"
        "    AsyncEngineArgs.add_cli_args(parser)\n"
        "    argv = [w for flag, value in fix.items() for w in (f'--{flag}', str(value))]\n"
        "    a = parser.parse_args(argv)\n"
        "    out.append({flag: getattr(a, flag.replace('-', '_')) for flag in fix})\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([str(ENGINE_VENV / "bin" / "python"), "-c", script], input=json.dumps(fixes), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == fixes
