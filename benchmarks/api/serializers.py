from rest_framework import serializers

from benchmarks.models import BenchmarkPoint, BenchmarkRun


class BenchmarkPointSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkPoint
        exclude = ["run"]


class BenchmarkRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkRun
        fields = ["id", "name", "deployment", "base_url", "served_model", "params", "status", "error", "environment",
                  "created", "started", "finished"]
