"""Reads a vLLM server's Prometheus /metrics while a level runs and sums it up per level."""
import threading
import time
import urllib.request

GAUGES = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    # vLLM V0 called it gpu_cache_usage_perc.
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
GENERATION_TOTAL = "vllm:generation_tokens_total"
WANTED = {name for names in GAUGES.values() for name in names} | {GENERATION_TOTAL}
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # like the load itself: no proxy


class ScrapeError(Exception):
    """The /metrics endpoint could not be read or parsed."""


def parse_prometheus(text: str, wanted=WANTED) -> dict[str, list[float]]:
    """Values of the wanted metric names, one per label set (samples of other names are skipped)."""
    values: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in wanted:
            continue
        rest = line[line.rfind("}") + 1:] if "{" in line else line[len(name):]
        fields = rest.split()
        if not fields:
            continue
        try:
            values.setdefault(name, []).append(float(fields[0]))
        except ValueError:
            continue
    return values


def sample(values: dict[str, list[float]]) -> dict[str, float]:
    """One reading: counts summed over engines, the KV cache fraction as the busiest engine's."""
    out = {}
    for key, names in GAUGES.items():
        for name in names:
            if name in values:
                series = values[name]
                out[key] = max(series) if key == "kv_cache_usage_perc" else sum(series)
                break
    if GENERATION_TOTAL in values:
        out["generation_tokens_total"] = sum(values[GENERATION_TOTAL])
    return out


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """One reading of the server's /metrics (urllib: httpx would log every request at INFO)."""
    try:
        with _OPENER.open(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError) as exc:
        raise ScrapeError(f"cannot read {url}: {exc}") from exc
    return sample(parse_prometheus(text))


def summarize(samples: list[tuple[float, dict]]) -> dict:
    """{gauge: {"max", "mean"}} plus generation_tok_s from the counter's rate, over one level."""
    summary: dict = {"samples": len(samples)}
    for key in GAUGES:
        series = [s[key] for _, s in samples if key in s]
        if series:
            summary[key] = {"max": max(series), "mean": sum(series) / len(series)}
    counter = [(t, s["generation_tokens_total"]) for t, s in samples if "generation_tokens_total" in s]
    if len(counter) >= 2 and counter[-1][0] > counter[0][0]:
        rates = [(v2 - v1) / (t2 - t1) for (t1, v1), (t2, v2) in zip(counter, counter[1:]) if t2 > t1]
        mean = (counter[-1][1] - counter[0][1]) / (counter[-1][0] - counter[0][0])
        summary["generation_tok_s"] = {"max": max(rates), "mean": mean}
    return summary


class Sampler:
    """A background thread reading /metrics every `interval_s` until stopped."""

    def __init__(self, url: str, interval_s: float = 0.5, timeout_s: float = 2.0):
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.samples: list[tuple[float, dict]] = []
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(self.timeout_s + 1)

    def latest(self) -> dict | None:
        """The last reading plus generation tok/s over the last two readings."""
        if not self.samples:
            return None
        (t2, last), out = self.samples[-1], dict(self.samples[-1][1])
        if len(self.samples) >= 2:
            t1, prev = self.samples[-2]
            if "generation_tokens_total" in last and "generation_tokens_total" in prev and t2 > t1:
                out["generation_tok_s"] = (last["generation_tokens_total"] - prev["generation_tokens_total"]) / (t2 - t1)
        return out

    def summary(self) -> dict:
        result = summarize(self.samples)
        if self.error:
            result["error"] = self.error
        return result

    def _run(self):
        while True:
            try:
                reading = scrape(self.url, self.timeout_s)
                self.samples.append((time.perf_counter(), reading))
                self.error = ""
            except ScrapeError as exc:
                self.error = str(exc)  # keep going: a level's numbers don't depend on /metrics
            if self._stop.wait(self.interval_s):
                # One last reading so the counter's rate covers the whole level.
                try:
                    self.samples.append((time.perf_counter(), scrape(self.url, self.timeout_s)))
                except ScrapeError:
                    pass
                return
