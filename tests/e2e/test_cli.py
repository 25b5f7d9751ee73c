"""panelctl end to end: deploy the tiny model on the real CPU engine, benchmark it next to the
engine, check the figures against `vllm bench serve` on the same engine, stop it — all through
the CLI and the REST API, with the exit codes scripts rely on."""
import json
import os
import subprocess
import sys

import pytest
from rest_framework.authtoken.models import Token

from benchmarks import runner
from deployments.host import engine
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


def vllm_bench(base_url, tokenizer, out_dir, prompts, round_):
    result = out_dir / f"vllm-bench-{round_}.json"
    subprocess.run([str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
                    "--endpoint", "/v1/chat/completions", "--model", "tiny", "--tokenizer", str(tokenizer),
                    "--dataset-name", "custom", "--dataset-path", str(prompts), "--custom-output-len", str(OUT_TOKENS),
                    "--ignore-eos", "--num-prompts", str(PROMPTS), "--max-concurrency", str(LEVEL), "--num-warmups", str(LEVEL),
                    "--request-rate", "inf", "--save-result", "--result-dir", str(out_dir), "--result-filename", result.name],
                   check=True, capture_output=True, timeout=600,
                   env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    return json.loads(result.read_text())


def test_panelctl_deploys_benchmarks_and_stops_a_real_engine(cpu_node, live_server_asgi, operator, tiny_model, tmp_path):
    node, model = cpu_node
    env = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": Token.objects.create(user=operator).key,
           "PANELCTL_CONFIG": str(tmp_path / "none.json")}
    port = free_port()

    code, out, err = panelctl(env, "deploy", str(model.pk), "--node", node.name, "--port", str(port), "--name", "cli-tiny",
                              "--flag", "max-model-len=2048", "--flag", "served-model-name=tiny", "--flag", "enforce-eager=",
                              "--env", "VLLM_CPU_KVCACHE_SPACE=1", "--wait", "--json")
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

    # The load generator and vllm bench serve, alternated on the same engine and prompts; each
    # one's best round counts. On this 2-core machine the engine, both clients and the panel share
    # the cores: single runs of either client vary by ±25 %, their best of three by a few percent.
    spec = runner.LoadSpec(base_url=f"http://127.0.0.1:{port}", model="tiny", prompt_source="jsonl",
                           prompts=runner.load_jsonl(prompts.read_text()), max_tokens=OUT_TOKENS, ignore_eos=True,
                           levels=(LEVEL,), min_requests=PROMPTS, requests_per_user=PROMPTS // LEVEL)
    theirs_rounds, ours_rounds = [], []
    for round_ in range(ROUNDS):
        theirs_rounds.append(vllm_bench(f"http://127.0.0.1:{port}", tiny_model, tmp_path, prompts, round_))
        level = in_thread(runner.sweep, spec).levels[0]  # a thread: Playwright may own this one's loop
        assert level.failed_requests == 0 and level.output_tokens == OUT_TOKENS * level.num_requests
        ours_rounds.append(level.to_dict())
    theirs = max(theirs_rounds, key=lambda r: r["output_throughput"])
    ours = max(ours_rounds, key=lambda p: p["output_throughput"])
    tok_s_ratio = ours["output_throughput"] / theirs["output_throughput"]
    ttft_ratio = ours["ttft_ms"]["median"] / theirs["median_ttft_ms"]
    print(f"output tok/s ours {ours['output_throughput']:.1f} vs vllm bench serve {theirs['output_throughput']:.1f} "
          f"({tok_s_ratio:.3f}); median TTFT {ours['ttft_ms']['median']:.2f} vs {theirs['median_ttft_ms']:.2f} ms ({ttft_ratio:.3f})")
    # Same definition of output tok/s, but on 2 shared cores even the best of three moves by up to
    # ~20 % (seen 0.82-1.05 here): this bound catches a client that measures something else (a
    # wrong token count or duration gave 0.49), not the 10 %, which needs a quieter host.
    assert 0.7 <= tok_s_ratio <= 1.3
    # vllm bench serve (0.32) stops its TTFT clock at vLLM's role-only first chunk ({"role":
    # "assistant", "content": ""}), which can leave before the first token (seen: 31 vs our 184 ms);
    # ours waits for the first token, so it is not much shorter than theirs (seen 0.88-5.9).
    assert ttft_ratio >= 0.6

    assert panelctl(env, "deploy", str(model.pk), "--node", node.name, "--flag", "max-modle-len=1")[0] == 2
    assert panelctl(env, "stop", "no-such-deployment")[0] == 5
    code, out, err = panelctl(env, "stop", "cli-tiny", "--wait")
    assert code == 0, err
    assert engine.port_free("0.0.0.0", port)
    code, out, _ = panelctl(env, "nodes", "--json")
    assert code == 0 and json.loads(out)[0]["name"] == node.name
