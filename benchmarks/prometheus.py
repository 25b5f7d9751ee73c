"""Prometheus metric families for benchmark runs: each level's summary figures (and its goodput and SLO
attainment when the run carried SLOs), labelled by run, level (a concurrency, or a rate "4/s") and
deployment, read from the BenchmarkRun and BenchmarkPoint rows.

State, not history (Prometheus keeps the history of what it scrapes): each deployment's latest finished run
(and the latest run against a bare URL), and the runs queued or running now. Older runs stay in the API and
the CSV export, so a scrape's size is bounded by the fleet, not by the runs kept."""
from collections.abc import Iterator

from django.db.models import Max, Q
from prometheus_client.core import GaugeMetricFamily

from benchmarks.models import BenchmarkPoint, BenchmarkRun
from deployments.prometheus import add_sample, gauge

RUN_LABELS = ["run", "deployment"]
LEVEL_LABELS = ["run", "deployment", "level"]
# (family, help, BenchmarkPoint field, factor to base units)
LEVEL_FIGURES = [
    ("panel_benchmark_output_tokens_per_second", "Output tokens per second over the level.", "output_throughput", 1),
    ("panel_benchmark_total_tokens_per_second", "Input and output tokens per second over the level.",
     "total_token_throughput", 1),
    ("panel_benchmark_requests_per_second", "Completed requests per second over the level.", "request_throughput", 1),
    ("panel_benchmark_tokens_per_second_per_user", "Output tokens per second seen by one stream.", "tok_s_per_user", 1),
    ("panel_benchmark_peak_tokens_per_second", "Highest output tokens per second in any second of the level.",
     "peak_tok_s", 1),
    ("panel_benchmark_requests", "Requests sent at the level.", "num_requests", 1),
    ("panel_benchmark_failed_requests", "Requests that failed at the level.", "failed_requests", 1),
    ("panel_benchmark_rejected_requests", "Of the failed requests, those the server refused for load (429, or vLLM's "
     "admission 503).", "rejected", 1),
    ("panel_benchmark_duration_seconds", "How long the level ran.", "duration_s", 1),
    ("panel_benchmark_energy_joules", "Joules the deployment's GPUs used over the level (NVML's energy counters).",
     "energy_j", 1),
    ("panel_benchmark_energy_net_joules", "The level's joules less the GPUs' idle draw over it: what serving cost.",
     "energy_net_j", 1),
]
# Latency distributions, stored in milliseconds as {"median", "p99", ...}.
LATENCIES = [
    ("panel_benchmark_ttft_seconds", "Time to first token.", "ttft_ms"),
    ("panel_benchmark_tpot_seconds", "Time per output token after the first.", "tpot_ms"),
    ("panel_benchmark_itl_seconds", "Time between token chunks.", "itl_ms"),
    ("panel_benchmark_e2e_seconds", "Whole request latency.", "e2e_ms"),
]
STATS = ("median", "p99")
# Against the run's SLOs (BenchmarkPoint.goodput and slo): only for levels of a run that carried SLOs.
SLO_FIGURES = [
    ("panel_benchmark_goodput_requests_per_second", "Requests per second meeting every SLO of the run, over the level."),
    ("panel_benchmark_slo_attainment_ratio", "Share of the level's measured requests that met every SLO of the run (0-1)."),
    ("panel_benchmark_slo_met", "1 when the level held every SLO of the run (each met by at least its percentile of "
                                "requests), else 0."),
]


def current_runs() -> Q:
    """The runs /metrics shows: each deployment's latest done run (the bare-URL runs count as one deployment)
    and every run not ended yet."""
    latest = (BenchmarkRun.objects.filter(status=BenchmarkRun.Status.DONE).values("deployment_id")
              .annotate(last=Max("pk")).values_list("last", flat=True))
    return Q(pk__in=list(latest)) | Q(status__in=BenchmarkRun.ACTIVE)


class BenchmarkCollector:
    """The current runs' state and figures (current_runs); a run against a bare URL has deployment="". Deployment names
    come from the caller, so that what this reads (and a cache of it) does not depend on the
    deployment table, which a loading engine writes every second."""

    def __init__(self, deployment_names: dict[int, str]):
        self.deployment_names = deployment_names

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = gauge("panel_benchmark_run_info", "A run's name, model and status (value 1).",
                      RUN_LABELS + ["name", "model", "status"])
        finished = gauge("panel_benchmark_run_finished_timestamp_seconds", "Unix time the run ended.", RUN_LABELS)
        single = gauge("panel_benchmark_single_stream_tokens_per_second", "Output tokens per second of one stream alone.",
                        RUN_LABELS)
        targets = {}
        shown = current_runs()
        for pk, name, deployment_id, served_model, status, ended, single_tok_s in BenchmarkRun.objects.filter(shown).values_list(
                "id", "name", "deployment_id", "served_model", "status", "finished", "single_stream_tok_s"):
            labels = targets[pk] = [str(pk), self.deployment_names.get(deployment_id, "")]
            info.add_metric(labels + [name, served_model, status], 1)
            if ended:
                finished.add_metric(labels, ended.timestamp())
            if single_tok_s is not None:
                single.add_metric(labels, single_tok_s)
        yield from (info, finished, single)

        figures = [(gauge(name, doc, LEVEL_LABELS), field, factor) for name, doc, field, factor in LEVEL_FIGURES]
        latencies = [(gauge(name, doc + " Milliseconds in the run's page, seconds here.", LEVEL_LABELS + ["stat"]), field)
                     for name, doc, field in LATENCIES]
        goodput, attainment, met = (gauge(name, doc, LEVEL_LABELS) for name, doc in SLO_FIGURES)
        fields = ["run_id", "concurrency", "kind", "rate", "goodput", "slo"] + [f for _, f, _ in figures] + [f for _, f in latencies]
        # A capacity search's repeats of one rate are one level here (the first): labels must not repeat.
        for row in BenchmarkPoint.objects.filter(run__in=list(targets), repeat=0).values_list(*fields):
            run = targets.get(row[0])
            if run is None:  # a point written after the runs were read
                continue
            level = f"{row[3]:g}/s" if row[2] == BenchmarkPoint.Kind.RATE else str(row[1])  # a rate level: "4/s"
            labels = {"run": run[0], "deployment": run[1], "level": level}
            by_stat = {stat: {**labels, "stat": stat} for stat in STATS}
            if row[4] is not None:  # the run carried SLOs
                add_sample(goodput, labels, row[4])
                add_sample(attainment, labels, (row[5] or {}).get("attainment_pct", 0.0) / 100)
                add_sample(met, labels, 1 if (row[5] or {}).get("met") else 0)
            values = iter(row[6:])
            for (family, _, factor), value in zip(figures, values):
                if value is not None:  # energy: none on a node without counters
                    add_sample(family, labels, value * factor)
            for family, _ in latencies:
                dist = next(values) or {}
                for stat in STATS:
                    if dist.get(stat) is not None:
                        add_sample(family, by_stat[stat], dist[stat] / 1000)
        yield from (family for family, _, _ in figures)
        yield from (family for family, _ in latencies)
        yield from (goodput, attainment, met)
