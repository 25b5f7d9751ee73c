"""How well the load generator keeps an open-loop schedule: rate levels against the known-schedule server.

For each case (Poisson at 1,000 requests/s, gamma with burstiness 0.5 at 1,000/s, Poisson at 100/s for
comparison, 3,000 requests) one rate level of 10,000 requests is sent to
tests/schedserver.py running as its own process with a fast schedule, and the script prints:
- the schedule lag, sent - due, of every request: p50, p99, max, and the share within 1 ms;
- a one-sample Kolmogorov-Smirnov test of the gaps between sends (what the server was sent) and of the
  drawn gaps (the schedule), against the asked distribution: exponential of mean 1/rate for Poisson,
  gamma of shape = burstiness and the same mean otherwise; its statistic D and asymptotic p-value
  (scipy is not needed: the Kolmogorov series and the incomplete gamma function are written out here);
- the achieved rate, and how many requests the server counted.
The last line is name=value figures of the 1,000/s Poisson case.

    .venv/bin/python perf/rate_schedule.py [--requests 10000]
"""
import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.runner import LoadSpec, due_offsets, run_rate  # noqa: E402
from benchmarks.runner.stats import percentile  # noqa: E402


def gamma_p(a: float, x: float) -> float:
    """The regularized lower incomplete gamma function P(a, x) (series below a + 1, continued fraction above)."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return total * math.exp(log_front)
    tiny = 1e-300
    b, c, d = x + 1 - a, 1 / tiny, 1 / (x + 1 - a)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return 1.0 - math.exp(log_front) * h


def ks_test(values: list[float], cdf) -> tuple[float, float]:
    """(D, p): the one-sample Kolmogorov-Smirnov statistic and its asymptotic p-value (Stephens' correction)."""
    xs = sorted(values)
    n = len(xs)
    d = max(max((i + 1) / n - cdf(x), cdf(x) - i / n) for i, x in enumerate(xs))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 101))
    return d, min(1.0, max(0.0, p))


def asked_cdf(rate: float, shape: float):
    scale = 1.0 / (rate * shape)
    if shape == 1.0:
        return lambda x: 1.0 - math.exp(-x / scale) if x > 0 else 0.0
    return lambda x: gamma_p(shape, x / scale)


def start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "schedserver.py"), "--port", "0", "--ttft-ms", "2",
                             "--gap-ms", "1"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    return proc, line.strip().rsplit(" ", 1)[-1]


def served(url: str) -> int:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/stats?reset=1", timeout=10) as response:
        return json.load(response)["requests"]


def case(url: str, rate: float, burstiness: float, requests: int) -> dict:
    spec = LoadSpec(base_url=url, model="sched", prompt_source="builtin", max_tokens=4, ignore_eos=False, levels=(),
                    rates=(rate,), arrival="poisson" if burstiness == 1 else "gamma", burstiness=burstiness,
                    min_requests=requests, rate_duration_s=requests / rate, workers=1, scrape_metrics=False, seed=1,
                    warmup_per_user=0)  # the server's count must be the level's requests alone
    served(url)
    level = run_rate(spec, rate)
    counted = served(url)
    records = level.records
    lags = sorted(r.start - r.due for r in records)
    starts = sorted(r.start for r in records)
    cdf = asked_cdf(rate, burstiness)
    d_sent, p_sent = ks_test([b - a for a, b in zip(starts, starts[1:])], cdf)
    drawn = due_offsets(spec, rate, requests)
    d_due, p_due = ks_test([b - a for a, b in zip(drawn, drawn[1:])], cdf)
    return {"rate": rate, "burstiness": burstiness, "requests": len(records), "completed": level.completed,
            "server_counted": counted, "achieved_rate": round(level.achieved_rate, 2),
            "lag_p50_ms": round(percentile(lags, 50) * 1000, 4), "lag_p99_ms": round(percentile(lags, 99) * 1000, 4),
            "lag_max_ms": round(lags[-1] * 1000, 4), "within_1ms": round(sum(x <= 0.001 for x in lags) / len(lags), 5),
            "ks_d_sent": round(d_sent, 5), "ks_p_sent": round(p_sent, 4), "ks_d_due": round(d_due, 5),
            "ks_p_due": round(p_due, 4)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    args = parser.parse_args()
    proc, url = start_server()
    try:
        time.sleep(0.5)
        results = [case(url, 1000.0, 1.0, args.requests), case(url, 1000.0, 0.5, args.requests),
                   case(url, 100.0, 1.0, min(args.requests, 3000))]
    finally:
        proc.terminate()
        proc.wait(10)
    for r in results:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    first = results[0]
    print(" ".join(f"{k}={first[k]}" for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "within_1ms", "ks_p_sent",
                                                "ks_p_due", "achieved_rate")))


if __name__ == "__main__":
    main()
