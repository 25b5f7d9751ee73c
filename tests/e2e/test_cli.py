"""panelctl end to end: deploy the tiny model on the real CPU engine, benchmark it next to the
engine, check the figures against `vllm bench serve` on the same engine, stop it — all through
the CLI and the REST API, with the exit codes scripts rely on."""
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
from rest_framework.authtoken.models import Token

from benchmarks import runner
from deployments.host import engine
from deployments.models import Deployment
from tests.conftest import ROOT, VLLM, free_port, in_thread

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
LEVEL, OUT_TOKENS, IN_TOKENS, PROMPTS, ROUNDS = 4, 64, 32, 96, 3


def panelctl(env, *args, timeout=900):
    result = subprocess.run([sys.executable, "-m", "controlpanel.cli", *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout, result.stderr


def prompts_file(out_dir):
    """The same prompts for both clients, so both send the same tokens."""
    import random

    rng = random.Random(7)
    words = "the model serves a request from a user who asks about weather maps trains and music".split()
    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(IN_TOKENS))}) + "\n"
                            for _ in range(PROMPTS)))
    return path


def vllm_bench(base_url, tokenizer, out_dir, prompts, round_, cpus):
    result = out_dir / f"vllm-bench-{round_}.json"
    subprocess.run([str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
                    "--endpoint", "/v1/chat/completions", "--model", "tiny", "--tokenizer", str(tokenizer),
                    "--dataset-name", "custom", "--dataset-path", str(prompts), "--custom-output-len", str(OUT_TOKENS),
                    "--ignore-eos", "--temperature", "0", "--num-prompts", str(PROMPTS), "--max-concurrency", str(LEVEL),
                    "--num-warmups", str(LEVEL), "--request-rate", "inf", "--save-result", "--result-dir", str(out_dir),
                    "--result-filename", result.name],
                   check=True, capture_output=True, timeout=600, preexec_fn=lambda: os.sched_setaffinity(0, cpus),
                   env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    return json.loads(result.read_text())


def pin_apart(engine_pids) -> set:
    """Every thread of the engine onto the first core; returns the other cores, for the clients."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return set(cpus)
    for pid in engine_pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), {cpus[0]})
            except OSError:  # a thread that just ended
                pass
    return set(cpus[1:])


def pinned(cpus, fn):
    """`fn`, run with the calling thread on `cpus` (Linux affinity is per thread)."""
    def call(*args, **kwargs):
        os.sched_setaffinity(0, cpus)
        return fn(*args, **kwargs)
    return call


def test_panelctl_deploys_benchmarks_and_stops_a_real_engine(cpu_node, live_server_asgi, operator, tiny_model, tmp_path):
    node, model = cpu_node
    env = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": Token.objects.create(user=operator).key,
           "PANELCTL_CONFIG": str(tmp_path / "none.json")}
    port = free_port()

    code, out, err = panelctl(env, "deploy", str(model.pk), "--node", node.name, "--port", str(port), "--name", "cli-tiny",
                              "--flag", "max-model-len=2048", "--flag", "served-model-name=tiny", "--flag", "enforce-eager=",
                              "--env", "VLLM_CPU_KVCACHE_SPACE=1", "--env", "VLLM_CPU_OMP_THREADS_BIND=0", "--wait", "--json")
    assert code == 0, err
    deployed = json.loads(out)
    assert deployed["status"] == "ready" and deployed["smoke"]["completion_tokens"] > 0
    assert "load" in err and "smoke_test" in err  # readable progress on stderr

    # The panel's own benchmark through the CLI: it runs on the node's agent, next to the engine.
    prompts = prompts_file(tmp_path)
    code, out, err = panelctl(env, "bench", "cli-tiny", "--concurrency", str(LEVEL), "--max-tokens", str(OUT_TOKENS),
                              "--prompts-file", str(prompts), "--requests-per-user", str(PROMPTS // LEVEL),
                              "--wait", "--json")
    assert code == 0, err
    panel_point = json.loads(out)["points"][0]
    assert panel_point["concurrency"] == LEVEL and panel_point["failed_requests"] == 0
    assert panel_point["output_tokens"] == OUT_TOKENS * panel_point["num_requests"] and panel_point["ttft_ms"]["median"] > 0
    print(f"panel run (on the agent): {panel_point['output_throughput']:.1f} tok/s, TTFT {panel_point['ttft_ms']['median']:.1f} ms")

    # The load generator and vllm bench serve, alternated on the same engine, prompts and sampling
    # (greedy). The engine is pinned to one core and the clients to the other, so neither client's
    # own work slows the engine it measures; the median of the rounds counts for each.
    engine_pids = engine.members(Deployment.objects.get(name="cli-tiny").pgid)
    client_cpus = pin_apart(engine_pids)
    spec = runner.LoadSpec(base_url=f"http://127.0.0.1:{port}", model="tiny", prompt_source="jsonl",
                           prompts=runner.load_jsonl(prompts.read_text()), max_tokens=OUT_TOKENS, ignore_eos=True,
                           temperature=0.0, levels=(LEVEL,), min_requests=PROMPTS, requests_per_user=PROMPTS // LEVEL)
    theirs_rounds, ours_rounds = [], []
    for round_ in range(ROUNDS):
        theirs_rounds.append(vllm_bench(f"http://127.0.0.1:{port}", tiny_model, tmp_path, prompts, round_, client_cpus))
        level = in_thread(pinned(client_cpus, runner.sweep), spec).levels[0]  # a thread: Playwright may own this loop
        assert level.failed_requests == 0 and level.output_tokens == OUT_TOKENS * level.num_requests
        ours_rounds.append(level.to_dict())
    ours_tok_s = statistics.median(p["output_throughput"] for p in ours_rounds)
    theirs_tok_s = statistics.median(r["output_throughput"] for r in theirs_rounds)
    ours_ttft = statistics.median(p["ttft_ms"]["median"] for p in ours_rounds)
    theirs_ttft = statistics.median(r["median_ttft_ms"] for r in theirs_rounds)
    print(f"rounds: ours {[round(p['output_throughput']) for p in ours_rounds]} tok/s, "
          f"TTFT {[round(p['ttft_ms']['median'], 1) for p in ours_rounds]} ms; vllm bench serve "
          f"{[round(r['output_throughput']) for r in theirs_rounds]} tok/s, TTFT {[round(r['median_ttft_ms'], 1) for r in theirs_rounds]} ms")
    print(f"output tok/s ours {ours_tok_s:.1f} vs vllm bench serve {theirs_tok_s:.1f} ({ours_tok_s / theirs_tok_s:.3f}); "
          f"median TTFT {ours_ttft:.2f} vs {theirs_ttft:.2f} ms ({ours_ttft / theirs_ttft:.3f})")
    assert ours_tok_s == pytest.approx(theirs_tok_s, rel=0.10)
    assert ours_ttft == pytest.approx(theirs_ttft, rel=0.10)

    assert panelctl(env, "deploy", str(model.pk), "--node", node.name, "--flag", "max-modle-len=1")[0] == 2
    assert panelctl(env, "stop", "no-such-deployment")[0] == 5
    code, out, err = panelctl(env, "stop", "cli-tiny", "--wait")
    assert code == 0, err
    assert engine.port_free("0.0.0.0", port)
    code, out, _ = panelctl(env, "nodes", "--json")
    assert code == 0 and json.loads(out)[0]["name"] == node.name
    assert re.match(r"^\d+\.\d+", json.loads(out)[0]["engine_version"])  # the agent asked `vllm --version`
