"""Prometheus HTTP service discovery (http_sd_config): every ready engine's /metrics, through its node's gateway."""
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments import scrapekey
from deployments.prometheus import engine_scrape_targets
from plumbing.scrapeaccess import ScrapeAccess


class EngineTargetsView(ScrapeAccess, APIView):
    @extend_schema(responses=dict, summary="Prometheus targets: each ready engine's /metrics")
    def get(self, request):
        """[{"targets": ["gateway host:port"], "labels": {"__metrics_path__", "node", "deployment", "model", "gpus"}}],
        as Prometheus' http_sd_config reads it; readable with the scrape token too. The gateways' key for the
        scrape token is kept in step first (scrapekey): Prometheus asks here before it scrapes what is listed."""
        scrapekey.ensure()
        return Response(engine_scrape_targets())
