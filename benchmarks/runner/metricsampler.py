"""Reads a vLLM server's /metrics (through host/vllm.py) while a level runs and sums it up per level."""
import threading
import time

from deployments.host import vllm


def summarize(samples: list[tuple[float, dict]]) -> dict:
    """{gauge: {"max", "mean"}} plus generation_tok_s from the counter's rate, over one level."""
    summary: dict = {"samples": len(samples)}
    for key in vllm.GAUGES:
        series = [s[key] for _, s in samples if key in s]
        if series:
            summary[key] = {"max": max(series), "mean": sum(series) / len(series)}
    counted = [(t, s) for t, s in samples if "generation_tokens_total" in s]
    mean = vllm.tok_s(counted[0], counted[-1]) if counted else None
    if mean is not None:
        rates = [rate for pair in zip(counted, counted[1:]) if (rate := vllm.tok_s(*pair)) is not None]
        summary["generation_tok_s"] = {"max": max(rates), "mean": mean}
    if cache := prefix_cache(samples):
        summary["prefix_cache"] = cache
    return summary


def prefix_cache(samples: list[tuple[float, dict]]) -> dict:
    """The engine's own prefix-cache counters over the level: {"queries", "hits" (prompt tokens), "hit_rate"};
    {} when the server has no such counters."""
    counted = [s for _, s in samples if "prefix_cache_queries_total" in s and "prefix_cache_hits_total" in s]
    if not counted:
        return {}
    queries = counted[-1]["prefix_cache_queries_total"] - counted[0]["prefix_cache_queries_total"]
    hits = counted[-1]["prefix_cache_hits_total"] - counted[0]["prefix_cache_hits_total"]
    return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries > 0 else 0.0}


class Sampler:
    """A background thread reading /metrics every `interval_s` until stopped."""

    def __init__(self, url: str, interval_s: float = 0.5, timeout_s: float = 2.0, key: str = ""):
        self.url, self.interval_s, self.timeout_s, self.key = url, interval_s, timeout_s, key
        self.samples: list[tuple[float, dict]] = []
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def __enter__(self):
        # The first reading before the level's first request, in the caller's thread: the counters' rates and the
        # prefix cache's figures then cover the whole level however late a busy host schedules the sampling thread.
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(self.timeout_s + 1)

    def latest(self) -> dict | None:
        """The last reading plus generation tok/s over the last two readings."""
        if not self.samples:
            return None
        out = dict(self.samples[-1][1])
        if len(self.samples) >= 2 and (rate := vllm.tok_s(self.samples[-2], self.samples[-1])) is not None:
            out["generation_tok_s"] = rate
        return out

    def summary(self) -> dict:
        result = summarize(self.samples)
        if self.error:
            result["error"] = self.error
        return result

    def _read(self) -> None:
        try:
            reading = vllm.read_metrics(self.url, self.timeout_s, key=self.key)
            self.samples.append((time.perf_counter(), reading))
            self.error = ""
        except vllm.VllmError as exc:
            self.error = str(exc)  # keep going: a level's numbers don't depend on /metrics

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self._read()
        self._read()  # one last reading, after the level's last request: the counters' rates cover all of it
