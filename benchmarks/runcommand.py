"""A run as commands to copy: the `panelctl bench` line that sends the same requests again, and where one exists the
`vllm bench serve` line per level that sends requests of the same shape.

The panelctl line names every setting the run's params hold that differs from what panelctl sends without it (the
levels and the seed always), so its request reaches the same params: the same prompts, schedule and levels
(tests/benchmarks/test_runcommand.py parses each line with panelctl's own parser and compares the run it makes).
vLLM's client draws its own prompts from the seed, so its line matches the shape (lengths, levels, rates, seed), not
the bytes; it exists for random prompts only (vLLM's `random` dataset)."""
import shlex

from benchmarks import runner
from benchmarks.models import BenchmarkRun, Workload

# Settings panelctl sends as the API's defaults unless told otherwise, and the option that changes each.
_OPTIONS = (("max_tokens", "--max-tokens"), ("requests_per_user", "--requests-per-user"),
            ("min_requests", "--min-requests"), ("warmup_per_user", "--warmup-per-user"),
            ("temperature", "--temperature"), ("request_timeout_s", "--request-timeout"), ("repeats", "--repeats"))
_GOODPUT = {"ttft": "ttft", "e2e": "e2el"}  # vLLM's goodput names for the SLO metrics it has (not ITL: its TPOT differs)
_RATE_OPTIONS = (("burstiness", "--burstiness"), ("max_concurrency", "--max-concurrency"), ("ramp", "--ramp"),
                 ("ramp_from", "--ramp-from"), ("rate_duration_s", "--rate-duration"))


def _get(p: dict, key: str):
    """A run's setting, or the runner's default where its params (an older row's) do not hold it."""
    return p[key] if key in p else runner.spec_default(key)


def _num(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _joined(values) -> str:
    return ",".join(_num(v) for v in values)


def panelctl_line(run: BenchmarkRun) -> tuple[str, str]:
    """The `panelctl bench` command that runs `run` again, and a note on what it needs ("" when nothing)."""
    p, note = run.params, ""
    if not (run.deployment_id or run.base_url):
        return "", "The deployment this run measured is deleted: a new run needs a deployment or a URL."
    if run.deployment_id:
        argv = ["panelctl", "bench", run.deployment.name]
    else:
        argv = ["panelctl", "bench", run.base_url, *(["--model", run.served_model] if run.served_model else [])]
    if p.get("levels"):
        argv += ["--concurrency", _joined(p["levels"])]
    if p.get("endpoint", runner.CHAT) != runner.CHAT:
        argv += ["--endpoint", "completions"]
    if p.get("workload_name"):
        if not Workload.objects.filter(pk=p.get("workload_id"), name=p["workload_name"]).exists():
            note = (f"The workload {p['workload_name']} this run used is deleted: the run keeps its own copy, "
                    "a new run needs it made again.")
        argv += ["--workload", p["workload_name"]]
    else:
        if _get(p, "input_tokens") != runner.spec_default("input_tokens"):
            argv += ["--input-tokens", _num(_get(p, "input_tokens"))]
        if p.get("prompt_source") == "jsonl":
            argv += ["--prompts-file", "prompts.jsonl"]
            note = "prompts.jsonl: the file of prompts this run was given (the run keeps them, not their file)."
        elif p.get("prompt_source", "random") != "random":
            argv += ["--prompts", p["prompt_source"]]
    for key, option in _OPTIONS:
        if key in p and p[key] != runner.spec_default(key) and not (key == "max_tokens" and p.get("workload_name")):
            argv += [option, _num(p[key])]
    if not p.get("ignore_eos", True):
        argv.append("--no-ignore-eos")
    if not p.get("stop_when_saturated", True):
        argv.append("--past-saturation")
    argv += _rate_options(p)
    argv += ["--seed", str(_get(p, "seed")), "--wait"]
    return shlex.join(argv), note


def _rate_options(p: dict) -> list[str]:
    out = []
    for slo in p.get("slos") or []:
        out += ["--slo", f"{slo['metric']}:p{slo['percentile']:g}:{slo['max_ms']:g}ms"]
    if search := p.get("capacity"):
        out += ["--capacity", f"{search['low']:g}-{search['high']:g}"]
        out += ["--capacity-width", _num(search["width"])] if search.get("width") else []
        out += ["--capacity-repeats", str(search["repeats"])] if search.get("repeats", 1) != 1 else []
    if not (p.get("rates") or search):
        return out
    out += ["--rate", _joined(p["rates"])] if p.get("rates") else []
    for key, option in _RATE_OPTIONS:
        if _get(p, key) != runner.spec_default(key):
            out += [option, _num(_get(p, key))]
    if _get(p, "arrival") != ("poisson" if _get(p, "burstiness") == 1 else "gamma"):  # not what the API infers
        out += ["--arrival", _get(p, "arrival")]
    return out


def vllm_bench_lines(run: BenchmarkRun) -> tuple[list[str], str]:
    """`vllm bench serve` lines sending requests of this run's shape, one per level, or none and why."""
    p = run.params
    if p.get("workload_name") or p.get("prompt_source", "random") != "random":
        source = p.get("workload_name") or p.get("prompt_source")
        return [], f"vllm bench serve has no dataset for this run's prompts ({source}): its random dataset only."
    if p.get("capacity"):
        return [], "vllm bench serve has no capacity search: run its rates one by one."
    if not (run.deployment_id or run.base_url):
        return [], "The deployment this run measured is deleted."
    chat = p.get("endpoint", runner.CHAT) == runner.CHAT
    base = ["vllm", "bench", "serve", "--backend", "openai-chat" if chat else "openai",
            "--base-url", _base_url(run), "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
            "--model", run.served_model, "--dataset-name", "random", "--random-input-len", str(_get(p, "input_tokens")),
            "--random-output-len", str(_get(p, "max_tokens")), "--random-range-ratio", "0", "--seed", str(_get(p, "seed")),
            "--temperature", _num(_get(p, "temperature")), "--percentile-metrics", "ttft,tpot,itl,e2el"]
    base += ["--ignore-eos"] if p.get("ignore_eos", True) else []
    if path := (run.environment or {}).get("model_path"):
        base += ["--tokenizer", path]
    goodput = [f"{_GOODPUT[s['metric']]}:{s['max_ms']:g}" for s in p.get("slos") or [] if s["metric"] in _GOODPUT]
    base += ["--goodput", *goodput] if goodput else []
    lines = []
    for c in p.get("levels") or []:
        n = max(_get(p, "min_requests"), _get(p, "requests_per_user") * c)
        lines.append(shlex.join([*base, "--num-prompts", str(n), "--max-concurrency", str(c),
                                 "--num-warmups", str(_get(p, "warmup_per_user") * c)]))
    for rate in p.get("rates") or []:
        n = max(_get(p, "min_requests"), round(rate * _get(p, "rate_duration_s")))
        level = ["--num-prompts", str(n), "--request-rate", f"{rate:g}", "--burstiness", f"{_get(p, 'burstiness'):g}"]
        level += ["--max-concurrency", str(_get(p, "max_concurrency"))] if p.get("max_concurrency") else []
        if p.get("ramp"):
            level += ["--ramp-up-strategy", _get(p, "ramp"), "--ramp-up-start-rps", f"{_get(p, 'ramp_from'):g}",
                      "--ramp-up-end-rps", f"{rate:g}"]
        lines.append(shlex.join([*base, *level]))
    skipped = "ITL has no goodput in vLLM's client: left out. " if len(goodput) < len(p.get("slos") or []) else ""
    note = skipped + ("vLLM's client draws its own random prompts from the seed: the same lengths and schedule, other text. "
            + ("It goes through the node's gateway: export OPENAI_API_KEY (a caller key) first; the key's own limits "
               "apply." if run.deployment_id else "Export OPENAI_API_KEY first where the server wants a key."))
    return lines, note


def _base_url(run: BenchmarkRun) -> str:
    """A deployment through its node's gateway (its engine listens on loopback), a URL as it was given."""
    return run.deployment.base_url if run.deployment_id else run.base_url.rstrip("/").removesuffix("/v1")


def commands(run: BenchmarkRun) -> dict:
    """What a run page and the API show: {"panelctl", "panelctl_note", "vllm" (lines), "vllm_note"}."""
    (line, note), (lines, vllm_note) = panelctl_line(run), vllm_bench_lines(run)
    return {"panelctl": line, "panelctl_note": note, "vllm": lines, "vllm_note": vllm_note}
