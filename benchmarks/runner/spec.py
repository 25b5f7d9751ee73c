"""What a benchmark asks for and what it measures: plain dataclasses, no Django."""
import copy
import math
import statistics
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from deployments.host.errors import HostError

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# A request's own timeout, unless the spec sets one: time for its first token plus its max_tokens at a floor rate per
# stream. A fixed timeout fails long answers at high concurrency: at c=1,024 a host's 2,276 tok/s is ~2.2 tok/s per
# stream, so a fixed 600 s failed every answer above ~1,300 tokens, and reasoning answers are longer. 0.5 tok/s
# leaves four times that margin (a stream slower still is stuck, not busy); the first token's allowance covers the
# queue and the prefill of long prompts at such a level; the minimum is the fixed timeout of before, so no request
# gets less time than it had; the maximum bounds what a stuck request can hold (and what may be asked for).
TIMEOUT_FLOOR_TOK_S = 0.5
TIMEOUT_FIRST_TOKEN_S = 300.0
MIN_REQUEST_TIMEOUT_S = 600.0
MAX_REQUEST_TIMEOUT_S = 86_400.0  # a day


MAX_REPEATS = 10  # a plain run's repeats of each level


def repeats_problem(value) -> str:
    """Why `value` cannot be a run's repeats ("" if it can)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPEATS:
        return f"repeats is a whole number from 1 to {MAX_REPEATS} (got {value!r})."
    return ""


class RunnerError(HostError):
    """A benchmark could not run; `permanent` says whether retrying the same spec can help."""


class PromptError(RunnerError):
    """Prompts (an uploaded JSONL) are unusable; the message names the line and the problem."""

    PERMANENT = True


@dataclass
class LoadSpec:
    """The workload: where to send it, what each request asks, how many per concurrency level."""

    base_url: str  # http(s)://host:port, optionally with a path prefix; a trailing /v1 is fine
    model: str
    endpoint: str = CHAT  # CHAT or COMPLETIONS
    prompt_source: str = "random"  # "random" (like vllm bench serve's dataset) | "builtin" | "jsonl"
    prompts: list = field(default_factory=list)  # entries from load_jsonl() for "jsonl"
    input_tokens: int = 128  # length of "random" prompts in the served model's tokens (see tokens.py)
    max_tokens: int = 128
    ignore_eos: bool = True  # every request generates max_tokens, so levels compare like for like
    temperature: float = 0.0
    levels: tuple = DEFAULT_LEVELS
    min_requests: int = 32  # per level: num_requests = max(min_requests, requests_per_user * c)
    requests_per_user: int = 4
    warmup_per_user: int = 1  # per level: warmup_per_user * c requests, excluded from metrics
    api_key: str = ""
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    continuous_usage_stats: bool = False  # ask vLLM for usage in every chunk (exact tokens per chunk)
    request_timeout_s: float | None = None  # seconds each request may take; None = its own (request_timeout)
    workers: int = 0  # measuring processes; 0 = auto (1 per 256 streams, at most cores - 1)
    busy_poll: bool | None = None  # spin instead of sleeping between reads; None = auto (>= 256 streams)
    tick_s: float = 0.5  # how often on_tick is called
    metrics_url: str = ""  # Prometheus /metrics of the server; "" = <base_url root>/metrics
    scrape_metrics: bool = True
    verify_tls: bool = True
    seed: int = 0
    tokenizer_path: str = ""  # the model's folder (tokenizer.json), for prompt lengths when there is no /tokenize
    stop_when_saturated: bool = True  # end the sweep once a level shows the engine saturated (saturation.py)
    # Open-loop levels (arrivals.py), run after the concurrency levels: requests/s, each a level.
    rates: tuple = ()
    arrival: str = "poisson"  # "poisson" | "gamma" (gaps of shape `burstiness`, as vllm bench serve's)
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more even
    max_concurrency: int = 0  # a rate level's cap on requests in flight (the rest wait for a slot); 0 = none
    ramp: str = ""  # "" | "linear" | "exponential": from ramp_from to the level's rate over its requests
    ramp_from: float = 0.0  # requests/s at the ramp's start (above 0 for an exponential ramp)
    rate_duration_s: float = 30.0  # a rate level sends max(min_requests, rate × this) requests
    # A structured workload (workloads.py): shared prefixes, multi-turn conversations, ShareGPT, a trace.
    workload: dict = field(default_factory=dict)
    # SLOs (slo.py): [{"metric": "ttft" | "itl" | "e2e", "percentile": 99, "max_ms": 2000}]; each level reports
    # its goodput and attainment against them.
    slos: list = field(default_factory=list)
    # A capacity search (capacity.py), run instead of the rates: {"low", "high", "width", "repeats"} in req/s.
    capacity: dict = field(default_factory=dict)
    # Times each concurrency and rate level is measured, one after another, each repeat with prompts (and arrivals)
    # of its own seed: a prefix cache serves no repeat from the one before. A capacity search repeats on its own.
    repeats: int = 1

    def num_requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_user * concurrency)

    def num_warmup(self, concurrency: int) -> int:
        return max(0, self.warmup_per_user * concurrency)


def request_timeout(spec: LoadSpec, max_tokens: int) -> float:
    """Seconds a request asking for `max_tokens` may take: the spec's request_timeout_s when set, else its own size
    at the floor rate plus the first token's allowance, within [MIN_REQUEST_TIMEOUT_S, MAX_REQUEST_TIMEOUT_S]."""
    if spec.request_timeout_s is not None:
        return float(spec.request_timeout_s)
    own = TIMEOUT_FIRST_TOKEN_S + max_tokens / TIMEOUT_FLOOR_TOK_S
    return min(MAX_REQUEST_TIMEOUT_S, max(MIN_REQUEST_TIMEOUT_S, own))


def timeout_problem(value) -> str:
    """Why `value` cannot be a request timeout ("" if it can; None asks for each request's own)."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "request_timeout_s is a number of seconds (or empty: each request's own, from its max_tokens)."
    if not value > 0:  # NaN included
        return f"request_timeout_s is seconds above 0 (got {value:g})."
    if value > MAX_REQUEST_TIMEOUT_S or math.isinf(value):
        return f"request_timeout_s is at most {MAX_REQUEST_TIMEOUT_S:,.0f} s (a day), not {value:,.0f}."
    return ""


def spec_default(name: str):
    """A LoadSpec field's default: the one source the form, the API and the run service read."""
    f = next(f for f in fields(LoadSpec) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else f.default


@dataclass
class RequestRecord:
    """One streamed request: absolute perf_counter times of its token chunks and its usage."""

    index: int
    warmup: bool = False
    start: float = 0.0  # when it was sent: the semaphore admitted it (and a rate level's due time came)
    due: float = 0.0  # a rate level: when its schedule said to send it
    slot_wait: float = 0.0  # a rate level with max_concurrency: seconds it waited for a free slot
    done: float = 0.0  # when the response ended (after usage and [DONE])
    chunk_times: list = field(default_factory=list)  # every chunk carrying a token
    chunk_kinds: bytearray = field(default_factory=bytearray)  # b"r" reasoning, b"c" content, b"t" tool call
    chunk_tokens: list | None = None  # tokens per chunk when the server sent usage in every chunk
    prompt_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int | None = None  # usage.completion_tokens_details.reasoning_tokens
    usage_seen: bool = False
    success: bool = False
    error: str = ""
    first_choice: float | None = None  # the first chunk without a token that carried a choice (vLLM's role-only chunk)
    timeout_s: float = 0.0  # how long it was given (spec.request_timeout)
    timed_out: bool = False  # ran past it
    rejected: bool = False  # refused for load: 429, or vLLM's admission 503 (vllm.ADMISSION_REFUSALS)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def ttft_vllm_bench(self) -> float:
        """TTFT as vllm bench serve counts it: to the first chunk carrying a choice, role-only included."""
        first = self.chunk_times[0] if self.first_choice is None else min(self.first_choice, self.chunk_times[0])
        return first - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def ttfc(self) -> float | None:
        """Time to the first content token (ours): reasoning and tool-call chunks don't count."""
        i = self.chunk_kinds.find(b"c")
        return None if i < 0 else self.chunk_times[i] - self.start


@dataclass
class Tick:
    """Live progress of a level, sent every tick_s."""

    concurrency: int  # a rate level's max_concurrency (0: none)
    elapsed_s: float  # since the level started
    tok_s: float  # output tokens received in the last window per second (estimated between usages)
    chunks_s: float
    in_flight: int
    completed: int
    failed: int
    server: dict | None = None  # latest /metrics gauges and generation tok/s
    rate: float = 0.0  # a rate level's requests/s; 0 at a concurrency level


@dataclass
class LevelResult:
    """Everything measured at one level (a concurrency, or a rate); names follow vllm bench serve, extras noted."""

    concurrency: int  # a rate level: its max_concurrency (0: none)
    num_requests: int = 0  # measured requests sent (warmup excluded)
    completed: int = 0
    failed_requests: int = 0
    warmup_requests: int = 0
    duration_s: float = 0.0  # first send to last completion
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    # Distributions in ms: {"mean", "median", "std", "p90", "p95", "p99"} (vllm bench serve's).
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    itl_ms: dict = field(default_factory=dict)
    e2e_ms: dict = field(default_factory=dict)
    # Ours, not in vllm bench serve.
    ttfc_ms: dict = field(default_factory=dict)  # {} when no request produced content (all reasoning)
    # TTFT as vllm bench serve counts it (first chunk with a choice, vLLM's role-only chunk included):
    # next to ours so a user comparing the two sees why they differ.
    ttft_vllm_bench_ms: dict = field(default_factory=dict)
    itl_per_token_ms: dict = field(default_factory=dict)
    reasoning_tokens: int = 0
    content_tokens: int = 0
    reasoning_split: str = "none"  # "usage" | "chunk_usage" | "chunks" (estimated) | "mixed" | "none"
    tokens_per_chunk: str = "estimated"  # "usage" (continuous_usage_stats) | "estimated"
    tok_s_per_user: float = 0.0  # decode tokens (all but each request's first) ÷ decode time, requests pooled
    peak_tok_s: float = 0.0  # best tick window
    server_metrics: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)  # distinct error messages, at most 10; timeouts apart:
    timeouts: int = 0  # measured requests that ran past their timeout (among failed_requests)
    rejected: int = 0  # measured requests the server refused for load (among failed_requests, not in errors)
    workers: int = 1
    cancelled: bool = False
    # Prompt length: what was asked (random prompts; None for built-in or uploaded ones), the mean the
    # server counted (usage.prompt_tokens), and how the prompts were sized.
    prompt_tokens_requested: int | None = None
    prompt_tokens_mean: float = 0.0
    prompt_tokens_counted_by: str = ""
    samples: dict = field(default_factory=dict, repr=False)  # stats.request_samples(records): for studies
    # Rate levels (arrivals.py): the requests/s asked (the end of a ramp), the cap, what was sent
    # ((n - 1) ÷ first to last send), the schedule lag (sent - due) and the waits for a slot under the
    # cap, in ms: {"p50", "p99", "max", "mean"} (slot waits also "count", of requests that waited).
    kind: str = "concurrency"  # "concurrency" | "rate"
    rate: float = 0.0
    max_concurrency: int = 0
    achieved_rate: float = 0.0
    lag_ms: dict = field(default_factory=dict)
    slot_wait_ms: dict = field(default_factory=dict)
    # Against the spec's SLOs (slo.evaluate): {"good", "goodput", "attainment_pct", "met", "each"}; {} without.
    slo: dict = field(default_factory=dict)
    repeat: int = 0  # which measurement of the level this is, from 0 (spec.repeats, or a capacity search's)
    # What a prefix cache could have served of the level's prompts (workloads.reuse): {"prompt_tokens",
    # "reusable_tokens", "share"}; {} for prompts without a known structure.
    prefix_reuse: dict = field(default_factory=dict)
    records: list = field(default_factory=list, repr=False)

    @property
    def label(self) -> str:
        """ "concurrency 8" or "4 req/s", as sentences name the level."""
        return f"{self.rate:g} req/s" if self.kind == "rate" else f"concurrency {self.concurrency}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the per-request records."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "records"}

    @classmethod
    def from_dict(cls, data: dict) -> "LevelResult":
        names = {f.name for f in fields(cls)} - {"records"}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class SweepResult:
    """The levels of a sweep, in order; `single_stream_tok_s` is the decode rate at concurrency 1 (total
    decode tokens ÷ total decode time, so 1000 / it is the mean TPOT in ms)."""

    levels: list = field(default_factory=list)
    cancelled: bool = False
    saturated: str = ""  # why the sweep stopped before its last level (saturation.py), "" if it did not
    capacity: dict = field(default_factory=dict)  # a capacity search's answer (capacity.search), {} without one

    @property
    def single_stream_tok_s(self) -> float | None:
        """Of concurrency 1 (the median over its repeats); None when it did not run."""
        rates = [lv.tok_s_per_user for lv in self.levels if lv.concurrency == 1 and lv.kind == "concurrency"]
        return statistics.median(rates) if rates else None
