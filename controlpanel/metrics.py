"""GET /metrics: the panel's figures in Prometheus' text format (README, "Prometheus and Grafana").

Built from rows and the telemetry the agents already sent (deployments.metrics, benchmarks.metrics);
a scrape never waits on an agent or an engine.
"""
from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from prometheus_client import CollectorRegistry, generate_latest
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.views import APIView

from benchmarks.metrics import BenchmarkCollector
from controlpanel.scrape import ScrapeAccess
from deployments.metrics import DeploymentCollector, FleetCollector

# The classic text format every Prometheus reads (prometheus_client >= 0.22 calls its output 1.0.0,
# the same text for names like ours).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
registry = CollectorRegistry(auto_describe=False)
for collector in (FleetCollector(), DeploymentCollector(), BenchmarkCollector()):
    registry.register(collector)


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
        return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE)
