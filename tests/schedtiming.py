"""tests/schedserver.py's clocks: when each request's bytes arrived, and how late its chunks left against their
schedule."""
import time

from aiohttp import web

perf_counter = time.perf_counter


class Lateness:
    """Histogram (10 µs buckets up to 100 ms, then one for later) of chunk lateness versus schedule."""

    BUCKETS_PER_S = 100_000
    LAST = 10_000

    def __init__(self):
        self.reset()

    def reset(self):
        self.counts = [0] * (self.LAST + 1)

    @property
    def max_us(self) -> float:
        top = max((b for b, c in enumerate(self.counts) if c), default=0)
        return (top + 1) * 1e6 / self.BUCKETS_PER_S

    def quantile_us(self, q: float) -> float:
        total = sum(self.counts)
        if not total:
            return 0.0
        rank, seen = q * total, 0
        for bucket, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return (bucket + 0.5) * 1e6 / self.BUCKETS_PER_S
        return self.max_us


class ArrivalProtocol(web.RequestHandler):
    """Notes when each request's bytes arrive, before aiohttp parses them."""

    arrived = 0.0

    def data_received(self, data: bytes) -> None:
        self.arrived = perf_counter()
        super().data_received(data)


class ArrivalServer(web.Server):
    def __call__(self) -> web.RequestHandler:
        return ArrivalProtocol(self, loop=self._loop, **self._kwargs)
