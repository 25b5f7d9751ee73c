from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from plumbing.apicache import cached_read
from plumbing.idempotency import idempotent
from plumbing.params import ids_param

from benchmarks import runrepeats, selectors, services
from benchmarks.api import serializers
from benchmarks.models import BenchmarkRun

IDS = OpenApiParameter("ids", str, description="comma-separated run ids")


def _ids(request) -> list[int]:
    return ids_param([request.query_params.get("ids", "")], "ids", limit=12)


class BenchmarkRunViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    lookup_value_regex = r"[0-9]+"
    serializer_class = serializers.BenchmarkRunSerializer
    queryset = BenchmarkRun.objects.select_related("deployment")

    @cached_read()
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses=serializers.BenchmarkRunDetailSerializer)
    def retrieve(self, request, *args, **kwargs):
        """One run, with the commands that run it again (`commands`)."""
        return Response(serializers.BenchmarkRunDetailSerializer(self.get_object()).data)

    @extend_schema(request=serializers.RunRequestSerializer, responses={202: serializers.BenchmarkRunSerializer})
    @idempotent
    def create(self, request):
        """Start a sweep; follow it with GET /api/runs/{id}/ and /points/ (or the run page, live)."""
        body = serializers.RunRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        v = dict(body.validated_data)
        run = services.run_create(deployment=v.pop("deployment", None), base_url=v.pop("base_url", ""),
                                  served_model=v.pop("served_model"), name=v.pop("name"), params=v, user=request.user)
        return Response(serializers.BenchmarkRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: serializers.BenchmarkRunSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def cancel(self, request, pk=None):
        """Cancel a run; finished levels stay."""
        run = services.run_cancel(self.get_object())
        return Response(serializers.BenchmarkRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=serializers.BenchmarkPointSerializer(many=True))
    @action(detail=True)
    @cached_read()
    def points(self, request, pk=None):
        """Results of the run, one point per concurrency level."""
        return Response(serializers.BenchmarkPointSerializer(self.get_object().points.all(), many=True).data)

    @extend_schema(parameters=[IDS], responses=dict)
    @action(detail=False)
    def compare(self, request):
        """Several runs side by side with their environments, and what changed between the first two."""
        runs = selectors.runs_with_points(_ids(request))
        diff = selectors.environment_diff(runs[0], runs[1]) if len(runs) >= 2 else []
        return Response({"runs": selectors.export_json(runs),
                         "diff": [{"setting": k, "a": a, "b": b} for k, a, b in diff],
                         # Each later run against the first at the levels measured more than once: per metric the
                         # difference with its 95 % interval over the repeats, and the verdict (benchmarks.runrepeats).
                         "over_repeats": [{**row, "run": row["run"].pk} for row in runrepeats.compared_to_first(runs)]})

    @extend_schema(parameters=[IDS, OpenApiParameter("as", str, enum=["json", "csv"])], responses=dict)
    @action(detail=False)
    def export(self, request):
        """Runs and their points as JSON, or one CSV row per level (`?as=csv`)."""
        runs = selectors.runs_with_points(_ids(request))
        if request.query_params.get("as") == "csv":
            return HttpResponse(selectors.export_csv(runs), content_type="text/csv")
        return Response(selectors.export_json(runs))
