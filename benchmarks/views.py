"""Benchmark pages."""
from django.shortcuts import get_object_or_404, render

from benchmarks.models import BenchmarkRun


def run_list(request):
    runs = BenchmarkRun.objects.select_related("deployment")
    return render(request, "benchmarks/run_list.html", {"runs": runs})


def run_detail(request, pk):
    run = get_object_or_404(BenchmarkRun.objects.select_related("deployment"), pk=pk)
    return render(request, "benchmarks/run_detail.html", {"run": run, "points": run.points.all()})
