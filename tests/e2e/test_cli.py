"""panelctl end to end: deploy the tiny model on the real CPU engine, benchmark it next to the
engine, check the figures against `vllm bench serve` on the same engine, stop it — all through
the CLI and the REST API, with the exit codes scripts rely on."""
import json
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks import runner
from controlpanel import tokens
from deployments.host import engine
from deployments.models import Deployment
from tests.conftest import ROOT, VLLM, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
# Long prompts (~1,600 tokens, prefix caching off) make TTFT mostly the engine's prefill, so the
# throughput and TTFT comparisons hold at concurrency LEVEL; short prompts (~20 tokens) make TTFT
# small, so a client that adds a few ms of its own shows.
LEVEL, OUT_TOKENS, IN_WORDS, SHORT_WORDS, PROMPTS, ROUNDS = 4, 64, 650, 8, 96, 3
# (name, concurrency, words a prompt, requests) of each compared case.
CASES = [("long", 1, IN_WORDS, 32), ("long", LEVEL, IN_WORDS, PROMPTS), ("short", 1, SHORT_WORDS, 48)]


def panelctl(env, *args, timeout=900):
    result = subprocess.run([sys.executable, "-m", "controlpanel.cli", *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout, result.stderr


def prompts_file(out_dir, count=PROMPTS, words=IN_WORDS):
    """The same prompts for both clients, so both send the same tokens."""
    import random

    rng = random.Random(7)
    vocabulary = "the model serves a request from a user who asks about weather maps trains and music".split()
    path = out_dir / f"prompts-{count}-{words}.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(vocabulary) for _ in range(words))}) + "\n"
                            for _ in range(count)))
    return path


def vllm_bench(base_url, tokenizer, out_dir, prompts, level, requests, round_, cpus):
    result = out_dir / f"vllm-bench-{prompts.stem}-{level}-{round_}.json"
    subprocess.run([str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
                    "--endpoint", "/v1/chat/completions", "--model", "tiny", "--tokenizer", str(tokenizer),
                    "--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template",
                    "--custom-output-len", str(OUT_TOKENS),
                    "--ignore-eos", "--temperature", "0", "--num-prompts", str(requests), "--max-concurrency", str(level),
                    "--num-warmups", str(level), "--request-rate", "inf", "--save-result", "--result-dir", str(out_dir),
                    "--result-filename", result.name],
                   check=True, capture_output=True, timeout=600, preexec_fn=lambda: os.sched_setaffinity(0, cpus),
                   env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    return json.loads(result.read_text())


def compare_with_vllm_bench(base_url, tokenizer, out_dir, cpus):
    """Per case: median over ROUNDS of each client's output tok/s and median TTFT, ours both ways
    (our own, and as vllm bench serve counts it), plus the spread of vllm bench serve's round medians."""
    ours, theirs = {}, {}
    for name, level, words, requests in CASES:
        prompts = prompts_file(out_dir, requests, words)
        # Each prompt as vllm bench serve's openai-chat backend sends it: a user message of text parts.
        as_parts = "".join(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": json.loads(line)["prompt"]}]}]})
                           + "\n" for line in prompts.read_text().splitlines())
        spec = runner.LoadSpec(base_url=base_url, model="tiny", prompt_source="jsonl", prompts=runner.load_jsonl(as_parts),
                               max_tokens=OUT_TOKENS, ignore_eos=True, temperature=0.0, levels=(level,),
                               min_requests=requests, requests_per_user=requests // level)
        our_rounds, their_rounds = [], []
        for round_ in range(ROUNDS):
            def theirs_once():
                their_rounds.append(vllm_bench(base_url, tokenizer, out_dir, prompts, level, requests, round_, cpus))

            def ours_once():
                with ThreadPoolExecutor(1) as pool:  # a thread: Playwright may own this loop; a loaded machine is slow
                    result = pool.submit(pinned(cpus, runner.sweep), spec).result(600).levels[0]
                assert result.failed_requests == 0 and result.output_tokens == OUT_TOKENS * result.num_requests
                our_rounds.append(result.to_dict())

            # Alternating order, so neither client always runs on an engine the other just warmed.
            for once in ((theirs_once, ours_once) if round_ % 2 == 0 else (ours_once, theirs_once)):
                once()
        # The same prompts reached the engine from both (vllm's custom dataset would wrap each one in
        # the chat template once more, hence --skip-chat-template).
        assert {p["input_tokens"] for p in our_rounds} == {r["total_input_tokens"] for r in their_rounds}
        print(f"{name} c={level}, {their_rounds[0]['total_input_tokens'] / requests:.0f} prompt tokens a request: "
              f"ours {[round(p['output_throughput']) for p in our_rounds]} tok/s, TTFT "
              f"{[round(p['ttft_ms']['median'], 2) for p in our_rounds]} ms, as vllm bench serve counts it "
              f"{[round(p['ttft_vllm_bench_ms']['median'], 2) for p in our_rounds]} ms; vllm bench serve "
              f"{[round(r['output_throughput']) for r in their_rounds]} tok/s, TTFT {[round(r['median_ttft_ms'], 2) for r in their_rounds]} ms")
        our_ttfts = [p["ttft_vllm_bench_ms"]["median"] for p in our_rounds]
        ours[name, level] = {"tok_s": statistics.median(p["output_throughput"] for p in our_rounds),
                             "tok_s_spread": spread([p["output_throughput"] for p in our_rounds]),
                             "ttft": statistics.median(p["ttft_ms"]["median"] for p in our_rounds),
                             "ttft_vllm_bench": statistics.median(our_ttfts), "ttft_spread": max(our_ttfts) - min(our_ttfts)}
        their_ttfts = [r["median_ttft_ms"] for r in their_rounds]
        theirs[name, level] = {"tok_s": statistics.median(r["output_throughput"] for r in their_rounds),
                               "tok_s_spread": spread([r["output_throughput"] for r in their_rounds]),
                               "ttft": statistics.median(their_ttfts), "ttft_spread": max(their_ttfts) - min(their_ttfts)}
    return ours, theirs


def spread(values: list[float]) -> float:
    """(max - min) / median of a client's round figures: how far one round may stray from another."""
    return (max(values) - min(values)) / statistics.median(values)


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
    env = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": tokens.issue(operator),
           "PANELCTL_CONFIG": str(tmp_path / "none.json")}
    port = free_port()

    code, out, err = panelctl(env, "deploy", str(model.pk), "--node", node.name, "--port", str(port), "--name", "cli-tiny",
                              "--flag", "max-model-len=2048", "--flag", "no-enable-prefix-caching=", "--flag", "served-model-name=tiny", "--flag", "enforce-eager=",
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
    # vLLM's role-only chunk comes before the first token, never after it.
    assert 0 < panel_point["ttft_vllm_bench_ms"]["median"] <= panel_point["ttft_ms"]["median"]
    print(f"panel run (on the agent): {panel_point['output_throughput']:.1f} tok/s, TTFT {panel_point['ttft_ms']['median']:.1f} ms")

    # The load generator and vllm bench serve on the same engine, prompts and sampling (greedy),
    # alternated round by round; the engine is pinned to one core and the clients to the other, so
    # neither client's own work slows the engine it measures. The median of the rounds counts.
    client_cpus = pin_apart(engine.members(Deployment.objects.get(name="cli-tiny").pgid))
    ours, theirs = compare_with_vllm_bench(f"http://127.0.0.1:{port}", tiny_model, tmp_path, client_cpus)
    for case in ours:
        print(f"{case}: output tok/s ours {ours[case]['tok_s']:.1f} vs vllm bench serve {theirs[case]['tok_s']:.1f} "
              f"({ours[case]['tok_s'] / theirs[case]['tok_s']:.3f}); median TTFT ours {ours[case]['ttft']:.2f}, as vllm bench "
              f"serve counts it {ours[case]['ttft_vllm_bench']:.2f} vs {theirs[case]['ttft']:.2f} ms "
              f"(its rounds spread {theirs[case]['ttft_spread']:.2f} ms)")
        # On a quiet machine: 0.979 (c=1, long), 1.019 (c=4), 0.996 (c=1, short), rounds within 4 %: 10 % holds.
        # Runs that read 0.77-0.87 shared the cores with other work: then either client's rounds spread by
        # 20-40 % (CI once: vllm bench serve 236/295/330 tok/s on one case), and a median of three cannot
        # tell 10 % apart. The tolerance is 10 %, or this run's own round-to-round spread when larger.
        rel = max(0.10, ours[case]["tok_s_spread"], theirs[case]["tok_s_spread"])
        print(f"{case}: tolerance {rel:.3f}")
        assert ours[case]["tok_s"] == pytest.approx(theirs[case]["tok_s"], rel=rel)
    # TTFT is compared on one stream. With several, closed-loop users fall into step differently
    # under each client (vllm bench serve starts them all at once after its warm-up), and the engine's
    # own TTFT (its /metrics histogram) then differed by ~8 % between the clients' runs: a property
    # of the load, not of the measurement. With long prompts prefill dominates: both our TTFTs are
    # within 10 % of vllm bench serve's.
    long_ = ("long", 1)
    assert ours[long_]["ttft"] == pytest.approx(theirs[long_]["ttft"], rel=0.10)
    assert ours[long_]["ttft_vllm_bench"] == pytest.approx(theirs[long_]["ttft"], rel=0.10)
    # Short prompts: TTFT is ~10 ms, so the clients' own overhead shows. Same definition on both sides.
    # The tolerance is this run's measured jitter: the larger spread of either client's round medians,
    # at least 2 ms (vllm bench serve itself reads ~1.2 ms above the truth at c=1 on a calm machine,
    # FACTS.md). Calm, a client adding 5 ms fails; on a loaded machine the spread says how little a
    # single run can tell (perf/bench_fidelity.py measures the client against an exact schedule).
    short = ("short", 1)
    tolerance = max(2.0, theirs[short]["ttft_spread"], ours[short]["ttft_spread"])
    print(f"short prompts: TTFT as vllm bench serve counts it, ours {ours[short]['ttft_vllm_bench']:.2f} vs "
          f"{theirs[short]['ttft']:.2f} ms, tolerance (measured jitter) {tolerance:.2f} ms")
    assert abs(ours[short]["ttft_vllm_bench"] - theirs[short]["ttft"]) <= tolerance, (ours[short], theirs[short])
    assert ours[short]["ttft_vllm_bench"] <= ours[short]["ttft"]

    assert panelctl(env, "deploy", str(model.pk), "--node", node.name, "--flag", "max-modle-len=1")[0] == 2
    assert panelctl(env, "stop", "no-such-deployment")[0] == 5
    code, out, err = panelctl(env, "stop", "cli-tiny", "--wait")
    assert code == 0, err
    assert engine.port_free("0.0.0.0", port)
    code, out, _ = panelctl(env, "nodes", "--json")
    assert code == 0 and json.loads(out)[0]["name"] == node.name
    assert re.match(r"^\d+\.\d+", json.loads(out)[0]["engine_version"])  # the agent asked `vllm --version`
