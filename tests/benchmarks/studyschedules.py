"""The schedules of tests/integration/test_study_verdicts.py, and what a punctual tests/schedserver.py delivers on
them as a study records it: the integration test runs them through the whole panel, and
tests/benchmarks/test_studystats.py judges the same trials computed here, with a host delay added, to show
how much delay the verdicts stand (the margin that makes the integration test's verdicts structural).

Each request of a schedule takes TTFT + 7 gaps (512 tokens in 8 chunks of 64), its gap drawn by the server
from gap x (1 ± 0.8), uniformly, with a random.Random(seed) whose draws go to the streamed requests in the
order they arrive: every fresh engine of a schedule draws the same gaps. The smoke test (64 tokens, not
streamed) is one chunk and draws nothing. "fast" streams 8x faster than the baseline (gaps of 32 ms against
256 ms); "same" is the baseline's schedule, seed included.
"""
import random

from benchmarks.studystats import Repeat

BASELINE = {"ttft_ms": 10, "gap_ms": 256, "tokens_per_chunk": 64, "jitter": 0.8, "seed": 7}
FAST = {**BASELINE, "gap_ms": 32}
# The fake engine picks its schedule by --max-num-seqs (tests/faults/fakevllm): the baseline and "same" run 1.
SCHEDULES = {"1": BASELINE, "16": FAST}
# One round: eight users, one request each, sent at once; no warmup.
WORKLOAD = {"levels": [8], "max_tokens": 512, "input_tokens": 16, "requests_per_user": 1, "min_requests": 8,
            "warmup_per_user": 0}
REPEATS = 4
CHUNKS = WORKLOAD["max_tokens"] // BASELINE["tokens_per_chunk"]


def request_seconds(schedule: dict) -> list[float]:
    """Each of a trial's requests' time on the schedule, from its arrival to its last chunk, in arrival order."""
    rng = random.Random(schedule["seed"])
    jitter = schedule["jitter"]
    return [(schedule["ttft_ms"] + (CHUNKS - 1) * schedule["gap_ms"] * (1 + rng.uniform(-jitter, jitter))) / 1000
            for _ in range(WORKLOAD["min_requests"])]


def floor_ms(schedule: dict) -> float:
    """The shortest a request of the schedule can take: its smallest gap every time (the server is never early)."""
    return schedule["ttft_ms"] + (CHUNKS - 1) * schedule["gap_ms"] * (1 - schedule["jitter"])


def delivered(schedule: dict, late_s: float = 0.0) -> Repeat:
    """One trial as the study records it (output tok/s at the level, each request's end-to-end ms), every request
    `late_s` later than its schedule (a busy host: the server writes late, the client reads late). All the
    requests go at once, so the level lasts as long as its longest request."""
    seconds = [s + late_s for s in request_seconds(schedule)]
    tokens = WORKLOAD["max_tokens"] * len(seconds)
    return Repeat(tokens / max(seconds), tuple(s * 1000 for s in seconds))
