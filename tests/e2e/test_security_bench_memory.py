"""The memory cap on the real CPU engine: the node agent's load generator limited to 128 MiB
(PANEL_BENCH_MEMORY_MB). A run within every cap (32 requests of short prompts) but carrying 100,000
uploaded prompts (~14 MB, the most lines a file may hold) outgrows that limit in the load generator's child
process: the run fails with a clear message, the engine keeps serving, and the same agent then
benchmarks it to the end. The engine it starts anyway is also checked from outside (tests/e2e/loopback.py): it
listens on loopback only, and its OpenAI routes answer only its key, which the panel's benchmark sends."""
import json
import shutil
from pathlib import Path

import pytest

from benchmarks import services
from benchmarks.models import BenchmarkRun
from deployments import engineapikey
from deployments.host import vllm
from deployments.models import Deployment
from deployments.services import deploys
from tests.conftest import free_port, in_thread, wait_until
from tests.e2e.conftest import start_cpu_node
from tests.e2e.loopback import assert_behind_loopback_and_key

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _ended(pk):
    run = BenchmarkRun.objects.get(pk=pk)
    return run if run.status in BenchmarkRun.TERMINAL else None


@pytest.mark.slow
def test_a_run_that_outgrows_the_load_generators_memory_fails_while_the_engine_keeps_serving(
        process_env, spawn, unique, tmp_path, tiny_model, stop_engines):
    """A real engine load (30-70 s on 2 shared cores) is what the test needs: an engine to keep serving."""
    # A copy the engine user can read (var/ is not theirs, and the built model.safetensors may be 0600).
    folder = Path(shutil.copytree(tiny_model, tmp_path / "tiny-model"))
    for path in [folder, *folder.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    node, model, _ = start_cpu_node(process_env, spawn, unique, tmp_path, folder, PANEL_BENCH_MEMORY_MB="128")
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(), name=f"tiny-{unique}",
                  env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"},
                  engine_args={"max-model-len": 2048, "served-model-name": "tiny", "enforce-eager": True})
    # Alone, a load takes 30-70 s; next to other engines on 2 shared cores it was seen taking 4 min.
    wait_until(lambda: Deployment.objects.get(pk=d.pk).status in ("ready", "failed"), timeout=420, interval=1,
               message="the engine to be ready")
    d.refresh_from_db()
    assert d.status == "ready", d.status_message
    assert_behind_loopback_and_key(d)
    key = engineapikey.of(d)
    base_url = f"http://127.0.0.1:{d.port}"
    filler = " ".join(["tell me about the history of the city and its people"] * 2)
    prompts = [{"prompt": f"Question {i}: {filler}?"} for i in range(100_000)]
    assert 12e6 < len("\n".join(json.dumps(p) for p in prompts)) < 20 * 2**20  # an upload the form takes
    params = {"levels": [1], "prompt_source": "jsonl", "prompts": prompts, "max_tokens": 8}
    big = in_thread(services.run_create, params=params, deployment=d)  # every cap passed: it is queued
    run = wait_until(lambda: _ended(big.pk), timeout=180, message="the big run to end")
    assert run.status == "failed", (run.status, run.error)
    assert run.error.startswith("The benchmark ran out of memory: the load generator ") and "(128 MiB)" in run.error
    # The engine kept serving: healthy, answering, the deployment still ready.
    assert vllm.health(base_url)
    assert vllm.smoke_test(base_url, "tiny", max_tokens=8, key=key).completion_tokens > 0
    assert Deployment.objects.get(pk=d.pk).status == "ready"
    # And the same agent benchmarks it to the end, under the same limit.
    small = in_thread(services.run_create, params={"levels": [1, 2], "max_tokens": 8, "min_requests": 4,
                                                   "requests_per_user": 2, "prompt_source": "builtin"}, deployment=d)
    run = wait_until(lambda: _ended(small.pk), timeout=300, message="the next run to end")
    assert run.status == "done", run.error
    assert [p.num_requests for p in run.points.all()] == [4, 4]
