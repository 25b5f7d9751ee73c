"""What a benchmark may ask for: prompt and output lengths within the deployment's max model
length, and requests per level and prompt bytes per run under the limits in settings. A refusal names
the limit and the value asked; runs (API and form) and studies are checked alike, before anything is
queued. The runner checks the lengths again against the server's own /v1/models when it starts."""
import re

from django.conf import settings

from benchmarks import runner
from benchmarks.runner import capacity as capacity_search
from plumbing.errors import ServiceError

GIB = 2**30
_HUMAN = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "K": 2**10, "M": 2**20, "G": 2**30}  # as vLLM reads them


def engine_max_len(value) -> int | None:
    """A --max-model-len value as vLLM reads it (2048, "32k" = 32,000, "32K" = 32,768); None for
    what is not a length ("auto", -1: vLLM picks one that fits)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    match = _HUMAN.match(str(value).strip())
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)]) or None


def _flag(args: dict, name: str):
    """A flag's value however it is spelled (--max_model_len, MAX-MODEL-LEN), None when absent."""
    return next((v for k, v in args.items() if str(k).lstrip("-").replace("_", "-").lower() == name), None)


def max_model_len(deployment, engine_args: dict | None = None) -> tuple[int | None, str]:
    """(max model length, where it comes from) of a deployment, or of it run with `engine_args`."""
    args = deployment.engine_args if engine_args is None else engine_args
    if (length := engine_max_len(_flag(args, "max-model-len"))) is not None:
        return length, "its --max-model-len"
    if deployment.model.context_length:
        return deployment.model.context_length, "its model's context length"
    return None, ""


def _spec(params: dict) -> runner.LoadSpec:
    keys = ("endpoint", "prompt_source", "prompts", "input_tokens", "max_tokens", "min_requests", "requests_per_user",
            "warmup_per_user", "rate_duration_s", "workload")
    return runner.LoadSpec(base_url="http://checked", model="", **{k: params[k] for k in keys if k in params})


def check(params: dict, deployment=None, engine_args: dict | None = None, name: str = "") -> None:
    """Refuse (ServiceError, a 400 naming the field) a run's params that break a limit; `engine_args`
    and `name` when the deployment will run with other flags (a study's variant)."""
    spec = _spec(params)
    levels = sorted({int(c) for c in params["levels"]})
    if deployment is not None:
        length, source = max_model_len(deployment, engine_args)
        if problem := runner.length_problem(spec, length):
            field = "max_tokens" if problem.startswith("max_tokens") else "input_tokens"
            raise ServiceError(f"{problem} of {name or deployment.name} ({source}).", field=field)
    limit = settings.BENCH_MAX_REQUESTS_PER_LEVEL
    top = levels[-1] if levels else 0
    measured, warmup = spec.num_requests(top), spec.num_warmup(top)
    if levels and measured + warmup > limit:
        field = "min_requests" if spec.min_requests >= spec.requests_per_user * top else "requests_per_user"
        raise ServiceError(f"Concurrency {top} would send {measured + warmup:,} requests ({measured:,} measured + "
                           f"{warmup:,} warm-up); the limit is {limit:,} per level "
                           "(PANEL_BENCH_MAX_REQUESTS_PER_LEVEL).", field=field)
    rates = sorted(float(r) for r in params.get("rates") or ())
    if search := params.get("capacity"):  # its rounds run below its high rate, each repeat a level
        rates = sorted(rates + [float(search["high"])] * (capacity_rounds(search) * int(search.get("repeats") or 1)))
    if rates and sum(runner.workloads.rate_level_requests(spec, rates[-1])) > limit:
        measured, warmup = runner.workloads.rate_level_requests(spec, rates[-1])
        raise ServiceError(f"{rates[-1]:g} requests/s for {spec.rate_duration_s:g} s would send "
                           f"{measured + warmup:,} requests ({measured:,} measured + {warmup:,} warm-up); the limit is "
                           f"{limit:,} per level (PANEL_BENCH_MAX_REQUESTS_PER_LEVEL).", field="rates")
    limit = settings.BENCH_MAX_PROMPT_BYTES
    counts = [spec.num_requests(c) + spec.num_warmup(c) for c in levels] + [sum(runner.workloads.rate_level_requests(spec, r)) for r in rates]
    requests = sum(counts)
    total = sum(runner.prompt_bytes(spec, n) for n in counts)
    if total > limit:
        field = "input_tokens" if spec.prompt_source == "random" else "prompt_source"
        raise ServiceError(f"The run would send about {_size(total)} of prompts ({requests:,} requests of about "
                           f"{_size(total // max(1, requests))}); the limit is {_size(limit)} per run "
                           "(PANEL_BENCH_MAX_PROMPT_BYTES).", field=field)


def check_study(deployment, workload: dict, variants: list[dict]) -> None:
    """A study's workload against the deployment as it is and as each variant would run it."""
    check(workload, deployment)
    for v in variants:
        if _flag(v["engine_args"], "max-model-len") is not None:
            check(workload, deployment, engine_args=v["engine_args"], name=f"{deployment.name} as {v['name']}")


def capacity_rounds(search: dict) -> int:
    return capacity_search.rounds_needed(float(search["low"]), float(search["high"]), float(search["width"]))


def _size(n: int) -> str:
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n:,} bytes"
