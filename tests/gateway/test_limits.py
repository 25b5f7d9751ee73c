"""A key's limits at their configured figures, over minutes of a simulated clock (KeyLimits takes `now`): callers
that retry when the 429's retry-after-ms says, as the OpenAI clients do."""
import heapq
import random

from deployments.gateway.keyset import Refused
from deployments.gateway.limits import KeyLimits
from tests.gateway.test_parts import key


def simulate(k, callers: int, seconds: float, duration, tokens: int, seed: int = 7):
    """`callers` loops of admit, hold for duration(rng), done(tokens); after a 429 each waits the retry-after-ms it
    was given. Returns ([(admitted at, finished at)], [in flight after each admission])."""
    rng, limits = random.Random(seed), KeyLimits()
    events = [(i * 0.001, i) for i in range(callers)]  # (when the caller tries next, caller)
    ending = []  # (when, tokens): requests in flight
    served, in_flight = [], []
    while events:
        now, caller = heapq.heappop(events)
        while ending and ending[0][0] <= now:
            heapq.heappop(ending)
            limits.done(tokens, now=now)
        if now >= seconds:
            continue
        try:
            limits.admit(k, now=now)
        except Refused as refused:
            assert refused.status == 429
            heapq.heappush(events, (now + max(1, int(refused.retry_after * 1000)) / 1000, caller))
            continue
        in_flight.append(limits.in_flight)
        end = now + duration(rng)
        heapq.heappush(ending, (end, tokens))
        served.append((now, end))
        heapq.heappush(events, (end, caller))
    return served, in_flight


def test_a_tokens_per_minute_limit_admits_that_many_tokens_a_minute_within_ten_percent():
    tpm, tokens = 6000, 50
    served, _ = simulate(key(tpm=tpm), callers=4, seconds=600, duration=lambda r: r.uniform(0.2, 1.5),
                         tokens=tokens)
    after_first = [(start, end) for start, end in served if start >= 60]
    per_minute = len(after_first) * tokens / 9
    assert 0.9 * tpm <= per_minute <= 1.1 * tpm, per_minute
    finished = sorted(end for _, end in served)
    busiest = max(sum(1 for end in finished if t <= end < t + 60) for t in range(60, 540, 5)) * tokens
    assert busiest <= 1.1 * tpm, busiest  # no minute, however it is cut, goes past the limit by more


def test_a_concurrency_cap_holds_exactly_that_many_requests_in_flight():
    served, in_flight = simulate(key(concurrency=5), callers=20, seconds=120,
                                 duration=lambda r: r.uniform(0.01, 2.0), tokens=10)
    assert max(in_flight) == 5 and in_flight.count(5) > 100  # reached again and again, never passed
    assert len(served) > 300
