"""panelctl end to end: deploy the tiny model on the real CPU engine, benchmark it through the CLI,
check that the panel's load generator sends the engine the same prompt tokens as `vllm bench serve`
does for the same prompts, stop it — with the exit codes scripts rely on.

No timing is compared here: how the two clients' tok/s and TTFT compare on the same engine is
perf/client_vs_vllm_bench.py's question (a shared machine decides such a comparison, not the code)."""
import json
import os
import random
import re
import subprocess
import sys

import pytest

from benchmarks import runner
from benchmarks.runner import tokens as runner_tokens
from deployments import engineapikey
from deployments.host import processenv, processes
from deployments.models import Deployment
from plumbing import tokens
from tests.conftest import ROOT, VLLM, free_port
from tests.e2e.holders import record_whole_host_holders

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
# PROMPTS is exactly the requests the CLI's bench sends at LEVEL (max(min_requests 32, 8 per user × 4)),
# so the measured requests (after LEVEL warm-ups) are every prompt of the file once, as vllm bench
# serve's --num-prompts PROMPTS are. Prompts of different lengths: a prompt lost, doubled or cut shows.
LEVEL, OUT_TOKENS, PROMPTS = 4, 16, 32


def panelctl(env, *args, timeout=400):
    result = subprocess.run([sys.executable, "-m", "panelctl.cli", *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout, result.stderr


def prompts_file(out_dir):
    """PROMPTS distinct prompts of 20 to 80 words (a ~3-token first request once crashed the CPU worker)."""
    rng = random.Random(7)
    vocabulary = "the model serves a request from a user who asks about weather maps trains and music".split()
    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(vocabulary) for _ in range(rng.randint(20, 80)))}) + "\n"
                            for _ in range(PROMPTS)))
    return path


def vllm_bench(base_url, tokenizer, out_dir, prompts, key=""):
    """One `vllm bench serve` run over every prompt of `prompts` at LEVEL; its --save-result JSON.
    (--skip-chat-template: its custom dataset would otherwise wrap each prompt in the chat template,
    which the server then applies once more.) `key`: the engine's, sent as vllm bench serve sends
    one, from OPENAI_API_KEY."""
    result = out_dir / "vllm-bench.json"
    subprocess.run([str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
                    "--endpoint", "/v1/chat/completions", "--model", "tiny", "--tokenizer", str(tokenizer),
                    "--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template",
                    "--custom-output-len", str(OUT_TOKENS), "--ignore-eos", "--temperature", "0",
                    "--num-prompts", str(PROMPTS), "--max-concurrency", str(LEVEL), "--num-warmups", "0",
                    "--request-rate", "inf", "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
                    "--result-filename", result.name],
                   check=True, capture_output=True, timeout=300,
                   env={**os.environ, **processenv.OFFLINE, **({"OPENAI_API_KEY": key} if key else {})})
    return json.loads(result.read_text())


@pytest.mark.slow
def test_panelctl_deploys_with_defaults_redeploys_changed_benchmarks_and_stops_a_real_engine(
        cpu_node, live_server_asgi, operator, tiny_model, tmp_path):
    """Slow: two real engine loads through the CLI (~30-60 s each on 2 cores: the deploy with nothing but the model,
    then the redeploy changed) and `vllm bench serve` (~15 s of imports) are what it tests. One engine serves the
    prompt-length sweeps, the CLI's benchmark and vllm bench serve."""
    node, model = cpu_node
    env = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": tokens.issue(operator),
           "PANELCTL_CONFIG": str(tmp_path / "none.json")}

    # Nothing but the model: the form's defaults, ready, and the repo id is the model name to call.
    code, out, err = panelctl(env, "deploy", str(model.pk), "--wait", "--json")
    assert code == 0, err
    deployed = json.loads(out)
    assert deployed["status"] == "ready" and deployed["node"] == node.name, err
    assert deployed["smoke"].get("completion_tokens", 0) > 0, err  # the step's message says why when it failed
    assert "load" in err and "smoke_test" in err  # readable progress on stderr
    d = Deployment.objects.get(pk=deployed["id"])
    assert deployed["call"]["models"] == [model.repo_id] == [d.served_model_name]  # the repo id, not a path

    # Random prompts sized with the server's /tokenize: what the server counts (usage.prompt_tokens) is
    # what was asked, within 2 tokens, through the chat template and without one.
    for endpoint in (runner.CHAT, runner.COMPLETIONS):
        for asked in (32, 100):
            # Straight to the engine, as the panel's own benchmark runs: on loopback, with its key.
            spec = runner.LoadSpec(base_url=f"http://127.0.0.1:{d.port}", model=d.served_model_name, endpoint=endpoint,
                                   api_key=engineapikey.of(d),
                                   prompt_source="random", input_tokens=asked, max_tokens=4, levels=(1,),
                                   min_requests=6, requests_per_user=1, warmup_per_user=0, scrape_metrics=False)
            level = runner.sweep(spec).levels[0]
            assert level.completed == 6 and level.prompt_tokens_counted_by == runner_tokens.SERVER
            counted = [r.prompt_tokens for r in level.records if r.success]
            print(f"{endpoint} asked {asked}: the server counted {counted}")
            assert all(abs(n - asked) <= 2 for n in counted), (endpoint, asked, counted)
            assert level.prompt_tokens_requested == asked and abs(level.prompt_tokens_mean - asked) <= 2

    # Redeployed changed, as the CLI's own `deploy --replace` example does: what the agent records as
    # holding the host (the whole-host claim of a node without GPUs) names none of the engine's own processes,
    # vLLM's titled EngineCore among them, so no "stop other processes" is needed.
    seen, record = record_whole_host_holders(node, model.copies.get(node=node).path)
    assert any(p.info["name"].startswith("VLLM::") for p in seen) and record == []
    port, name = d.port, d.name
    deploy = ["deploy", str(model.pk), "--node", node.name, "--port", str(port), "--name", name,
              "--flag", "max-model-len=2048", "--flag", "no-enable-prefix-caching=", "--flag", "served-model-name=tiny",
              "--flag", "enforce-eager=", "--env", "VLLM_CPU_KVCACHE_SPACE=1", "--env", "VLLM_CPU_OMP_THREADS_BIND=0"]
    code, out, err = panelctl(env, *deploy, "--replace", "--flag", "max-num-seqs=8", "--wait", "--json")
    assert code == 0, err
    redeployed = json.loads(out)
    assert redeployed["id"] == deployed["id"] and redeployed["status"] == "ready"
    assert redeployed["engine_args"]["max-num-seqs"] in (8, "8") and redeployed["stop_foreign"] is False
    assert redeployed["call"]["models"] == ["tiny"]

    # The panel's own benchmark through the CLI: it runs on the node's agent, next to the engine.
    prompts = prompts_file(tmp_path)
    code, out, err = panelctl(env, "bench", name, "--concurrency", str(LEVEL), "--max-tokens", str(OUT_TOKENS),
                              "--prompts-file", str(prompts), "--requests-per-user", str(PROMPTS // LEVEL),
                              "--wait", "--json")
    assert code == 0, err
    point = json.loads(out)["points"][0]
    assert point["concurrency"] == LEVEL and point["failed_requests"] == 0 and point["num_requests"] == PROMPTS
    assert point["output_tokens"] == OUT_TOKENS * PROMPTS and point["ttft_ms"]["median"] > 0
    # vLLM's role-only chunk comes before the first token, never after it.
    assert 0 < point["ttft_vllm_bench_ms"]["median"] <= point["ttft_ms"]["median"]

    # The same prompts from vllm bench serve reach the engine as the same tokens (the server's usage
    # counts both): our request body (content, chat template, special tokens) is what vLLM's own
    # client sends.
    theirs = vllm_bench(f"http://127.0.0.1:{port}", tiny_model, tmp_path, prompts,
                        key=engineapikey.of(Deployment.objects.get(pk=d.pk)))
    assert theirs["completed"] == PROMPTS and theirs["total_output_tokens"] == OUT_TOKENS * PROMPTS
    assert point["input_tokens"] == theirs["total_input_tokens"], (point["input_tokens"], theirs["total_input_tokens"])

    assert panelctl(env, "deploy", str(model.pk), "--node", node.name, "--flag", "max-modle-len=1")[0] == 2
    assert panelctl(env, "stop", "no-such-deployment")[0] == 5
    code, out, err = panelctl(env, "stop", name, "--wait")
    assert code == 0, err
    assert processes.port_free("0.0.0.0", port)
    code, out, _ = panelctl(env, "nodes", "--json")
    assert code == 0 and json.loads(out)[0]["name"] == node.name
    assert re.match(r"^\d+\.\d+", json.loads(out)[0]["engine_version"])  # the agent asked `vllm --version`
