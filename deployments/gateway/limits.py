"""Limits the gateway enforces before an engine sees a request: each key's requests per second (a token bucket),
tokens per minute (a sliding minute) and concurrency; each deployment's in-flight bound with a bounded queue.

All state is in memory, per gateway process, and survives reloads (held by key id and deployment id); a key's
limits are read from its current Key on every check, so an edited limit applies at the next reload.
Over a limit: keyset.Refused(429) with the seconds after which trying again can succeed.
"""
import asyncio
import math
import time
from collections import deque

from deployments.gateway.config import Key
from deployments.gateway.keyset import Refused

clock = time.monotonic


class TokenBucket:
    """`rate` tokens a second, holding at most one second's worth (at least one)."""

    __slots__ = ("tokens", "stamp")

    def __init__(self):
        self.tokens, self.stamp = None, 0.0

    def take(self, rate: float, now: float) -> float:
        """0 when a token was taken, else the seconds until one is there."""
        capacity = max(1.0, rate)
        if self.tokens is None:
            self.tokens = capacity
        else:
            self.tokens = min(capacity, self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate


class MinuteWindow:
    """Tokens used in the last 60 s, in one-second slots."""

    __slots__ = ("slots", "total")

    def __init__(self):
        self.slots: deque = deque()  # (second, tokens)
        self.total = 0

    def _expire(self, now: float) -> None:
        while self.slots and self.slots[0][0] <= now - 60:
            self.total -= self.slots.popleft()[1]

    def add(self, tokens: int, now: float) -> None:
        second = math.floor(now)
        if self.slots and self.slots[-1][0] == second:
            self.slots[-1][1] += tokens
        else:
            self.slots.append([second, tokens])
        self.total += tokens

    def wait(self, limit: int, now: float) -> float:
        """0 when under `limit`, else the seconds until enough of the window has passed."""
        self._expire(now)
        if self.total < limit:
            return 0.0
        over = self.total - limit + 1
        for second, tokens in self.slots:
            over -= tokens
            if over <= 0:
                return max(0.001, second + 60 - now)
        return 60.0


class KeyLimits:
    """One key's counters."""

    __slots__ = ("bucket", "window", "in_flight")

    def __init__(self):
        self.bucket, self.window, self.in_flight = TokenBucket(), MinuteWindow(), 0

    def admit(self, key: Key, now: float | None = None) -> None:
        """Count one request in, or Refused(429)."""
        now = clock() if now is None else now
        if key.concurrency is not None and self.in_flight >= key.concurrency:
            raise Refused(429, "rate_limit_exceeded", f"The key {key.prefix}… has {key.concurrency} requests in "
                          "flight already (its concurrency limit).", retry_after=1.0, kind="rate_limit_error")
        if key.tpm is not None:
            wait = self.window.wait(key.tpm, now)
            if wait:
                raise Refused(429, "rate_limit_exceeded", f"The key {key.prefix}… used its {key.tpm} tokens per "
                              "minute.", retry_after=wait, kind="rate_limit_error")
        if key.rps is not None and key.rps > 0:
            wait = self.bucket.take(key.rps, now)
            if wait:
                raise Refused(429, "rate_limit_exceeded", f"The key {key.prefix}… is limited to {key.rps:g} "
                              "requests per second.", retry_after=wait, kind="rate_limit_error")
        self.in_flight += 1

    def done(self, tokens: int, now: float | None = None) -> None:
        self.in_flight -= 1
        if tokens:
            self.window.add(tokens, clock() if now is None else now)


class Admission:
    """A deployment's in-flight bound and its queue: requests beyond the bound wait in order; beyond the queue,
    Refused(429) (the engine's own waiting queue never grows past what the gateway lets in)."""

    __slots__ = ("in_flight", "waiters")

    def __init__(self):
        self.in_flight = 0
        self.waiters: deque = deque()

    @property
    def load(self) -> int:
        return self.in_flight + len(self.waiters)

    async def acquire(self, bound: int, queue_bound: int, name: str) -> None:
        if self.in_flight < bound and not self.waiters:
            self.in_flight += 1
            return
        if len(self.waiters) >= queue_bound:
            raise Refused(429, "deployment_busy", f"{name} has {self.in_flight} requests in flight and {queue_bound} "
                          "waiting; try again shortly.", retry_after=1.0, kind="rate_limit_error")
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            await waiter  # release() hands its slot over: in_flight already counts this request
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(bound)  # handed a slot just as it was cancelled: pass it on
            else:
                self.waiters.remove(waiter)
            raise

    def release(self, bound: int) -> None:
        while self.waiters and self.in_flight <= bound:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1


def retry_after_header(seconds: float | None) -> str:
    """Retry-After is whole seconds (RFC 9110): rounded up, at least 1."""
    return str(max(1, math.ceil(seconds or 1)))
