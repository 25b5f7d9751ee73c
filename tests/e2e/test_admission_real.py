"""Admission the engine enforces, with the real CPU engine and `--max-num-queued-reqs 1`. A request for two sequences
(n=2, two of the cap's one place) straight at the engine gets vLLM's own 503; the same through the gateway gets the
gateway's 429 with Retry-After, counted as refused for its key. Streams sent together with nothing in flight meet vLLM's
two checks: the one before it answers (a 503) and the one as it adds the request, which refuses inside a 200 stream;
the gateway answers both with the same 429, and a benchmark level counts both as rejected, not as errors. The engine's
own counter (vllm:admission_rejections_total, read by the panel's parser) holds every refusal.

Why no request held in flight to be refused behind: a short request sent once the first token of a 1,000-token stream
had arrived was admitted in one run of four. vLLM counts a request until its engine has made the last token, not until
the client has read it, so a reader starved on 2 busy cores can get its first token after the engine is done."""
import asyncio

import httpx
import pytest

from benchmarks.runner import LoadSpec, run_level
from deployments.gateway.models import Usage
from deployments.host import vllm
from tests.conftest import VLLM, run_async, wait_until
from tests.e2e.test_gateway import bearer, engine_on_loopback, start_gateway
from tests.factories import NodeFactory
from tests.gateway.conftest import make_deployment, make_key

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not VLLM.exists(), reason=f"no engine at {VLLM}: run scripts/install-engine"),
]

# ~20 tokens: vLLM 0.32's CPU worker died of SIGILL on a 3-token first request on this machine (FACTS.md).
PROMPT = "The capital of France is a city that many people visit every year, and its name is"
SHORT = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
TWO = {**SHORT, "n": 2}


def _counted(d) -> tuple[int, int]:
    """Requests and refusals the gateway counted for `d`."""
    rows = Usage.objects.filter(deployment=d).values_list("requests", "refused")
    return sum(r for r, _ in rows), sum(f for _, f in rows)


def _refusals(port: int, key: str) -> float:
    return vllm.read_engine(vllm.metrics_url(f"http://127.0.0.1:{port}"), key=key)[1].refused


def test_the_engines_admission_cap_is_a_503_direct_a_429_with_retry_after_through_the_gateway_and_rejections_in_a_level(
        tiny_model, tmp_path, process_env, spawn):
    with engine_on_loopback(tiny_model, tmp_path, **{"max-num-queued-reqs": 1, "max-num-seqs": 4}) as (port, key):
        node = NodeFactory(name="admission-e2e", address="127.0.0.1")
        d = make_deployment(node, port, served="tiny", engine_key=key)
        caller = make_key()
        gateway = start_gateway(spawn, process_env, node.name)
        direct = f"http://127.0.0.1:{port}"
        before = _refusals(port, key)
        with httpx.Client(timeout=120) as client:
            assert client.post(direct + "/v1/completions", json=SHORT, headers=bearer(key)).status_code == 200
            # Two sequences (n=2) take two of the cap's one place: refused whatever else is in flight, at once.
            own = client.post(direct + "/v1/completions", json=TWO, headers=bearer(key))
            through = client.post(gateway + "/v1/completions", json=TWO, headers=bearer(caller))
        assert own.status_code == 503 and vllm.refused_for_load(503, own.json()["error"]["message"]), own.text
        assert through.status_code == 429, through.text
        assert through.headers["Retry-After"] == "1" and through.json()["error"]["message"] == own.json()["error"][
            "message"]

        # Streams sent together, nothing else in flight: vLLM refuses some at its first check (503) and some at its
        # second, inside a 200 whose only event is the error. A caller of the gateway sees a 429 either way.
        async def burst(base: str, bearing: str) -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as many:
                return await asyncio.gather(*[many.post(base + "/v1/completions", headers=bearer(bearing),
                                                        json={**SHORT, "max_tokens": 512, "ignore_eos": True,
                                                              "stream": True})
                                              for _ in range(8)])
        kinds = {"served": 0, "503": 0, "in the stream": 0}  # how the engine itself answered a burst
        for reply in run_async(burst(direct, key), timeout=120):
            inside = reply.status_code == 200 and '"error"' in reply.text
            assert reply.status_code in (200, 503) and (
                reply.status_code == 200 and not inside or vllm.refused_for_load(503, reply.text)), reply.text
            kinds["in the stream" if inside else "503" if reply.status_code == 503 else "served"] += 1
        print(f"\nburst of 8 straight at the engine: {kinds}")
        replies = run_async(burst(gateway, caller), timeout=120)  # Playwright may own this thread's loop
        codes = sorted(r.status_code for r in replies)
        assert codes[0] == 200 and codes.count(429) == len(codes) - codes.count(200) > 0, codes
        assert all('"error"' not in r.text for r in replies if r.status_code == 200)
        assert all(r.headers["Retry-After"] == "1" for r in replies if r.status_code == 429)
        burst_refused = codes.count(429)
        wait_until(lambda: _counted(d) == (1 + len(replies), 1 + burst_refused), timeout=15, message="usage flushed")

        # A level of 4 streams against a cap of 1: whatever was refused is counted as rejected, not as an error.
        spec = LoadSpec(base_url=direct, model="tiny", api_key=key, input_tokens=24, max_tokens=400, min_requests=8,
                        requests_per_user=2, warmup_per_user=0, workers=1, tick_s=0.2, stop_when_saturated=False)
        level = run_level(spec, 4)
        print(f"burst of 8 through the gateway: {codes}; level c=4 against a cap of 1: {level.completed} completed, {level.failed_requests} failed, "
              f"{level.rejected} rejected, errors {level.errors}")
        assert level.rejected > 0 and level.rejected == level.failed_requests and not level.errors
        assert level.completed + level.rejected == level.num_requests
        # The engine's own count: the two above, the bursts' and the level's.
        assert _refusals(port, key) - before == 2 + kinds["503"] + kinds["in the stream"] + burst_refused + level.rejected
