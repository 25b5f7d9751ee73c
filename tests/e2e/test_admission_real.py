"""vLLM's own admission control on the real CPU engine: started with `--max-num-queued-reqs 1`, it refuses a request
past its cap with its 503 "currently busy" (vllm/exceptions.py QueueOverflowError) and counts it in
`vllm:admission_rejections`. The node gateway answers that refusal as 429 with Retry-After and counts it per key as
refused for load; the benchmark runner counts such refusals per level as rejected, failed but not errors."""
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.db.models import Sum

from benchmarks.runner.spec import LoadSpec
from benchmarks.runner.sweep import run_level
from deployments.gateway.models import Usage
from deployments.host import processes, processlog, serveargv, vllm
from tests.conftest import VLLM, free_port, wait_until
from tests.e2e.test_gateway import START_TIMEOUT_S, bearer, start_gateway
from tests.factories import NodeFactory
from tests.gateway.conftest import make_deployment, make_key

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 1900,
        "ignore_eos": True, "stream": True, "temperature": 0}
SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def capped_engine(tiny_model, tmp_path):
    """The CPU engine with --max-num-queued-reqs 1 (one request in the engine at a time): (port, key)."""
    port, key = free_port(), secrets.token_urlsafe(32)
    argv = serveargv.build_argv(str(VLLM), str(tiny_model), port, "127.0.0.1", {
        "enforce-eager": True, "max-model-len": 2048, "served-model-name": "tiny", "max-num-queued-reqs": 1})
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_API_KEY": key}
    log_path = tmp_path / "engine.log"
    handle = processes.launch(processes.EngineSpec(argv, env, log_path, cwd=tmp_path))
    base, started = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        while not vllm.health(base):
            if not processes.alive(handle.pid, handle.create_time):
                pytest.fail("engine exited while starting:\n" + "\n".join(processlog.tail(log_path, 40)))
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail("engine not up:\n" + "\n".join(processlog.tail(log_path, 40)))
            time.sleep(0.3)
        yield port, key
    finally:
        processes.stop(handle.pgid, term_timeout_s=5.0)


def _rejections(base: str, key: str) -> float:
    """vllm:admission_rejections_total, all reasons, as the agent reads it (deployments/host/slo.py)."""
    return vllm.read_engine(vllm.metrics_url(base), key=key)[1].refused


def _running(base: str, key: str) -> float:
    return vllm.read_metrics(vllm.metrics_url(base), key=key).get("num_requests_running", 0)


def _holding(url: str, key: str) -> threading.Thread:
    """A long streamed request in a thread of its own: the engine's one admitted request while it runs."""
    def hold():
        with httpx.Client(timeout=300) as client:
            client.post(url + "/v1/chat/completions", json=LONG, headers=bearer(key))
    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    return holder


@pytest.mark.slow
def test_the_engines_admission_cap_is_a_429_at_the_gateway_counted_per_key_and_rejected_in_a_benchmark_level(
        capped_engine, process_env, spawn):
    """Slow: a real engine start (20-70 s on 2 shared cores) and streams of a few hundred tokens."""
    port, engine_key = capped_engine
    base = f"http://127.0.0.1:{port}"
    node = NodeFactory(name="gw-e2e-admission", address="127.0.0.1")
    d = make_deployment(node, port, served="tiny", engine_key=engine_key)
    key = make_key()
    gateway = start_gateway(spawn, process_env, node.name)
    warm = httpx.post(gateway + "/v1/chat/completions", json=SHORT, headers=bearer(key), timeout=60)
    assert warm.status_code == 200, warm.text  # the gateway's key, route and connection ready: no first-call delay
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):  # the tiny model is fast: a hold that ended before both were asked is tried again
            # vLLM's admission counts the requests its scheduler last reported (the stats behind the running gauge),
            # so the gauge must first show nothing running (the warm-up gone), then the long request.
            wait_until(lambda: _running(base, engine_key) == 0, timeout=60, message="nothing running")
            holder = _holding(base, engine_key)
            wait_until(lambda: _running(base, engine_key) >= 1, timeout=60, message="the long request to run")
            asked = [pool.submit(httpx.post, url + "/v1/chat/completions", json=SHORT, headers=bearer(k), timeout=60)
                     for url, k in ((base, engine_key), (gateway, key))]
            direct, refused = (a.result() for a in asked)
            holder.join(300)
            if direct.status_code == 503 and refused.status_code == 429:
                break
    said = vllm.openai_error(direct.text) or ""
    assert direct.status_code == 503 and vllm.refused_for_load(503, said), direct.text
    assert _rejections(base, engine_key) >= 2
    assert (refused.status_code, refused.headers.get("Retry-After")) == (429, "1"), refused.text
    assert refused.json()["error"]["message"].startswith("The engine is currently busy")
    counted = wait_until(lambda: (t := Usage.objects.filter(deployment=d).aggregate(
        requests=Sum("requests"), errors=Sum("errors"), refused=Sum("refused")))["refused"] and t, timeout=15,
        message="the gateway's usage flushed")
    assert counted["refused"] == counted["errors"] >= 1, counted  # every 429 counted refused for load, per key

    spec = LoadSpec(base_url=base, model="tiny", api_key=engine_key, input_tokens=16, max_tokens=48, min_requests=6,
                    requests_per_user=2, warmup_per_user=0, scrape_metrics=False, tokenizer_path="",
                    stop_when_saturated=False)
    level = run_level(spec, 3)
    print(f"\nengine's admission cap 1, 3 streams: {level.num_requests} requests, {level.failed_requests} failed, "
          f"{level.rejected} refused for load, errors {level.errors}; the engine counted "
          f"{_rejections(base, engine_key):.0f} admission rejections")
    assert level.rejected > 0 and level.rejected == level.failed_requests, level
    assert not level.errors, level.errors  # refusals for load are not the engine's errors
