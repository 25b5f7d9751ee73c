"""The `vllm bench serve` lines a run page shows (benchmarks/runcommand.py), read by the real engine's own argument
parser: what it parses is what the run asked (levels, rates, lengths, seed, ramp, goodput)."""
import json
import subprocess

import pytest

from benchmarks import runcommand
from benchmarks.models import BenchmarkRun
from tests.benchmarks.test_runcommand import BODIES, URL
from tests.conftest import ENGINE_VENV

pytestmark = pytest.mark.e2e


@pytest.mark.django_db
def test_vllms_own_parser_reads_every_vllm_bench_line_as_the_run_asked(api, settings, sent_tasks):
    """The real engine's `vllm bench serve` parser (vllm.benchmarks.serve.add_cli_args) reads each line; the values it
    parses are the run's: levels, rates, lengths, seed, ramp, goodput."""
    settings.BENCHMARK_URL_ALLOWLIST = [URL]
    expected = []
    for case in ("defaults", "rates and SLOs", "levels and rates"):
        answer = api.post("/api/runs/", {"base_url": URL, "served_model": "kimi", **BODIES[case]},
                                      format="json")
        run = BenchmarkRun.objects.get(pk=answer.json()["id"])
        lines, _ = runcommand.vllm_bench_lines(run)
        p = run.params
        for level, line in zip([*(("c", c) for c in p["levels"]), *(("r", r) for r in p.get("rates", []))], lines):
            expected.append((line, level, p))
    script = (
        "import json, shlex, sys\n"
        "from vllm.benchmarks.serve import add_cli_args\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "out = []\n"
        "for line in json.load(sys.stdin):\n"
        "    parser = FlexibleArgumentParser()\n"
        "    add_cli_args(parser)\n"
        "    a = parser.parse_args(shlex.split(line)[3:])\n"
        "    out.append({k: getattr(a, k) for k in ('backend', 'endpoint', 'model', 'dataset_name', 'random_input_len',"
        " 'random_output_len', 'num_prompts', 'max_concurrency', 'request_rate', 'burstiness', 'seed', 'ignore_eos',"
        " 'goodput', 'ramp_up_strategy', 'ramp_up_start_rps', 'ramp_up_end_rps')})\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([str(ENGINE_VENV / "bin" / "python"), "-c", script], input=json.dumps([e[0] for e in expected]),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for parsed, (line, (kind, value), p) in zip(json.loads(done.stdout), expected):
        assert (parsed["backend"], parsed["endpoint"], parsed["model"]) == ("openai-chat", "/v1/chat/completions", "kimi")
        assert (parsed["dataset_name"], parsed["random_input_len"], parsed["random_output_len"]) == (
            "random", p["input_tokens"], p["max_tokens"])
        assert parsed["seed"] == p["seed"] and parsed["ignore_eos"] == p["ignore_eos"]
        if kind == "c":
            assert parsed["max_concurrency"] == value and parsed["request_rate"] == float("inf")
            assert parsed["num_prompts"] == max(p["min_requests"], p["requests_per_user"] * value)
        else:
            assert parsed["request_rate"] == value and parsed["burstiness"] == p["burstiness"]
            assert parsed["num_prompts"] == max(p["min_requests"], round(value * p["rate_duration_s"]))
        if p.get("slos"):
            names = {"ttft": "ttft", "e2e": "e2el"}  # vLLM has no ITL goodput
            assert parsed["goodput"] == [f"{names[s['metric']]}:{s['max_ms']:g}" for s in p["slos"] if s["metric"] in names]
        if p.get("ramp"):
            assert (parsed["ramp_up_strategy"], parsed["ramp_up_end_rps"]) == (p["ramp"], value)
