from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from benchmarks.api import serializers
from benchmarks.models import BenchmarkRun


class BenchmarkRunViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = serializers.BenchmarkRunSerializer
    queryset = BenchmarkRun.objects.all()

    @action(detail=True)
    def points(self, request, pk=None):
        """Results of the run, one point per concurrency level."""
        run = self.get_object()
        return Response(serializers.BenchmarkPointSerializer(run.points.all(), many=True).data)
