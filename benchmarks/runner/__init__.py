"""The benchmark load generator: streams OpenAI-compatible requests and measures them (no Django).

    spec = LoadSpec(base_url="http://gpu1:8000", model="Qwen/Qwen3-8B", levels=(1, 8, 64))
    result = sweep(spec, on_level=save_point, on_tick=push_live, cancel=stop_requested)
    result = sweep_in_child(spec, ..., memory_bytes=2**32)  # the same in a child under a memory limit
    spec = LoadSpec(..., levels=(), rates=(2, 4, 8), burstiness=0.5, arrival="gamma")  # open-loop levels

Metrics follow `vllm bench serve` (TTFT, TPOT, ITL, E2E, throughputs); the extras (time to first
content token, per-token ITL, reasoning/content split, tok/s per user) are labelled as ours.
May import deployments.host (the vLLM client, host errors), plumbing's plain files and its own modules; no Django.
"""
from .child import sweep_in_child
from .memory import MemoryLimitError
from .prompts import BUILTIN, load_jsonl, prompt_bytes
from .spec import (CHAT, COMPLETIONS, DEFAULT_LEVELS, MAX_REPEATS, LevelResult, LoadSpec, PromptError, RequestRecord,
                   RunnerError, SweepResult, Tick, repeats_problem, request_timeout, spec_default, timeout_problem)
from .stats import distribution, percentile, request_samples, summarize
from .sweep import Sweeper, length_problem, run_level, run_rate, sweep
from .arrivals import ARRIVALS, RAMPS, due_offsets, rate_requests
from . import workfiles, workloads

__all__ = [
    "workfiles", "workloads", "ARRIVALS", "BUILTIN", "CHAT", "RAMPS", "due_offsets", "rate_requests", "run_rate", "COMPLETIONS", "DEFAULT_LEVELS", "LevelResult", "LoadSpec", "MemoryLimitError", "PromptError",
    "RequestRecord", "RunnerError", "SweepResult", "Sweeper", "Tick", "distribution", "length_problem", "load_jsonl",
    "percentile", "prompt_bytes", "request_samples", "request_timeout", "run_level", "spec_default", "summarize",
    "sweep", "timeout_problem", "MAX_REPEATS", "repeats_problem",
    "sweep_in_child",
]
