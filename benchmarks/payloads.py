"""The live messages of benchmark runs and studies: their topics ("run:<id>", "study:<id>", registered in
BenchmarksConfig.ready()), payload shapes and senders; plumbing.live publishes them and knows nothing of
benchmarks. The browser code in static/panel/ reads these field names."""
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.models import BenchmarkRun, Study
from plumbing.live import publishing
from plumbing.live.publishing import pick
from plumbing.live.topics import Topic, exists_in

RUN = Topic("run", existing=exists_in(BenchmarkRun))
STUDY = Topic("study", existing=exists_in(Study))
TOPICS = (RUN, STUDY)


@dataclass(frozen=True)
class RunStatus:
    """kind "status" on run:<id>."""

    status: str
    status_display: str
    error: str
    single_stream_tok_s: float | None
    warnings: list[str]
    capacity: dict  # a capacity search's answer, with its sentence ("text"); {} for other runs

    @classmethod
    def of(cls, run) -> "RunStatus":
        return pick(cls, run, status_display=run.get_status_display())


@dataclass(frozen=True)
class RunPoint:
    """kind "point.<concurrency>" (a rate level: "point.r<rate>") on run:<id>: one finished level (also the
    page's initial points)."""

    kind: str  # "concurrency" | "rate"
    concurrency: int  # a rate level's cap (0: none)
    rate: float  # a rate level's requests/s asked
    achieved_rate: float
    lag_ms: dict  # sent - due: {"p50", "p99", "max", "mean"}
    slot_wait_ms: dict
    output_throughput: float
    total_token_throughput: float
    request_throughput: float
    ttft_ms: dict  # {"mean", "median", "std", "p90", "p95", "p99"}
    ttft_vllm_bench_ms: dict  # TTFT as vllm bench serve counts it (role-only chunk included)
    ttfc_ms: dict
    tpot_ms: dict
    itl_ms: dict
    itl_per_token_ms: dict
    e2e_ms: dict
    tok_s_per_user: float
    reasoning_tokens: int
    content_tokens: int
    output_tokens: int
    num_requests: int
    failed_requests: int
    timeouts: int  # of failed_requests, those that ran past their timeout
    rejected: int  # of failed_requests, those the server refused for load (429, vLLM's admission 503)
    errors: list  # the other failures' distinct messages
    warmup_requests: int  # sent before the measured ones, in none of the figures
    server_metrics: dict
    prompt_tokens_requested: int | None  # random prompts: the length asked for, in the model's tokens
    prompt_tokens_mean: float  # what the server counted (usage.prompt_tokens), per request
    prompt_tokens_counted_by: str
    energy_j: float | None  # the deployment's GPUs over the level (NVML); None without energy counters
    watts_per_gpu: float | None
    joules_per_token: float | None  # energy_j per output token
    energy_net_j: float | None  # energy_j less the GPUs' idle draw over the level (benchmarks/energy.py)
    joules_per_token_net: float | None  # energy_net_j per output token
    goodput: float | None  # requests/s meeting every SLO of the run; None without SLOs
    slo: dict  # {"good", "goodput", "attainment_pct", "met", "each": [...]} (runner/slo.py)
    repeat: int  # a capacity search's repeat of the same rate

    @classmethod
    def of(cls, point) -> "RunPoint":
        def per_token(joules):
            return round(joules / point.output_tokens, 4) if joules is not None and point.output_tokens else None

        return pick(cls, point, joules_per_token=per_token(point.energy_j),
                    joules_per_token_net=per_token(point.energy_net_j))


@dataclass(frozen=True)
class RunTick:
    """kind "tick" on run:<id>, not kept: tok/s over time while a level runs."""

    t: float  # seconds since the run started
    concurrency: int
    tok_s: float
    in_flight: int
    completed: int
    failed: int
    server: dict
    rate: float = 0.0  # a rate level's requests/s; 0 at a concurrency level


def send_run_status(run) -> None:
    publishing.publish(RUN.name(run.pk), "status", asdict(RunStatus.of(run)))


def run_point_data(point) -> dict[str, Any]:
    """A stored level as the browser gets it, live or in the page's initial data."""
    return asdict(RunPoint.of(point))


def send_run_point(run_id: int, point) -> None:
    key = (f"r{point.rate:g}" if point.kind == point.Kind.RATE else str(point.concurrency)) + (
        f"/{point.repeat}" if point.repeat else "")
    publishing.publish(RUN.name(run_id), f"point.{key}", run_point_data(point))


def send_run_tick(run_id: int, tick: RunTick) -> None:
    publishing.publish(RUN.name(run_id), "tick", asdict(tick), keep=False)


def send_study(study_id: int, data: dict[str, Any]) -> None:
    """kind "study" on study:<id>: the whole study as benchmarks.studyresults.study_live builds it (status,
    variants, the variant x level matrix of trials, the trial in progress, results once done)."""
    publishing.publish(STUDY.name(study_id), "study", data)
