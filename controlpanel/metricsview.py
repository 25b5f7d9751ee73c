"""GET /metrics: the panel's figures in Prometheus' text format (docs/monitoring.md).

Built from rows and the telemetry the agents already sent (deployments.prometheus, benchmarks.prometheus);
a scrape never waits on an agent or an engine. The collectors yield prometheus_client metric
families; they are written out here rather than by prometheus_client's generate_latest, which
costs ~15 µs a sample (it validates and escapes every label name of every sample): a fleet of
32 nodes x 8 GPUs with 1,000 benchmark runs is ~60,000 samples. Benchmark runs change rarely, so
their part is kept between scrapes until a table it read changes (plumbing.apicache).
"""
import math
import time
from contextlib import contextmanager

import redis
from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from prometheus_client.core import CounterMetricFamily
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.views import APIView

from benchmarks.prometheus import BenchmarkCollector
from deployments.gateway.prometheus import UsageCollector
from deployments.prometheus import DeploymentCollector, DownloadCollector, FleetCollector
from deployments.models import Deployment, Node
from plumbing import apicache
from plumbing.live import drops
from plumbing.scrapeaccess import ScrapeAccess

# The classic text format every Prometheus reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def _number(value) -> str:
    if type(value) is int:  # not bool
        return str(value)
    if math.isfinite(value):
        return repr(float(value))
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


def render(families) -> str:
    """Gauge families in the text format (label names are the collectors' own, valid by construction)."""
    families = list(families)  # all alive until the end: `written` is keyed by id()
    out = []
    written = {}  # id(labels dict) -> its text: samples that share one dict (a GPU's figures) share it
    for family in families:
        doc = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {family.name} {doc}\n# TYPE {family.name} {family.type}\n")
        for name, sample_labels, value, *_ in family.samples:
            labels = written.get(id(sample_labels))
            if labels is None:
                labels = written[id(sample_labels)] = (
                    "{" + ",".join([f'{k}="{_escape(v)}"' for k, v in sample_labels.items()]) + "}" if sample_labels else "")
            out.append(f"{name}{labels} {value if type(value) is int else _number(value)}\n")
    return "".join(out)


def exposition(timings: dict | None = None) -> bytes:
    """Everything /metrics answers: the fleet's live figures, then the parts kept between scrapes
    while neither a table they read nor a name they print changed. `timings` (perf/metrics_scrape.py)
    gets each part's seconds."""
    timed = _timer(timings)
    with timed("versions"):
        try:
            current = apicache.versions()
        except redis.RedisError:
            current = None
    with timed("node names"):
        nodes = dict(Node.objects.values_list("id", "name"))  # every heartbeat writes this table: read it each time
    with timed("gpus"):
        gpus = apicache.cached_value(("metrics", "gpus"), FleetCollector.gpu_rows, current)
        fleet = render(FleetCollector(gpus).collect()).encode()
    with timed("deployment names"):
        deployments = apicache.cached_value(("metrics", "deployment names"),
                                            lambda: dict(Deployment.objects.values_list("id", "name")), current)
    with timed("live drops"):
        parts = [fleet, render(_live()).encode()]
    with timed("usage"):
        parts.append(render(UsageCollector().collect()).encode())  # the gateways flush it every ~2 s: read it each time
    for collector, names in ((DeploymentCollector(nodes), nodes), (DownloadCollector(nodes), nodes),
                             (BenchmarkCollector(deployments), deployments)):
        key = ("metrics", type(collector).__name__, tuple(names.items()))
        with timed(type(collector).__name__):
            parts.append(apicache.cached_value(key, lambda c=collector: render(c.collect()).encode(), current))
    return b"".join(parts)


def _timer(timings: dict | None):
    @contextmanager
    def timed(name):
        started = time.perf_counter()
        try:
            yield
        finally:
            if timings is not None:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - started
    return timed


def _live():
    try:
        dropped = drops.dropped()
    except redis.RedisError:
        return
    yield CounterMetricFamily("panel_live_dropped_messages", "Live messages the Channels layer dropped because a "
                              "socket's queue was full (LIVE_CHANNEL_CAPACITY); 0 while every browser keeps up.", value=dropped)


class PlainTextRenderer(BaseRenderer):
    """Errors for a client that accepts only text (Prometheus accepts anything, with */*)."""

    media_type = "text/plain"
    format = "txt"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return JSONRenderer().render(data)


class MetricsView(ScrapeAccess, APIView):
    renderer_classes = [JSONRenderer, PlainTextRenderer]

    @extend_schema(exclude=True)
    def get(self, request):
        return HttpResponse(exposition(), content_type=CONTENT_TYPE)
