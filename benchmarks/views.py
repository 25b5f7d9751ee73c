"""Benchmark pages: runs with a new-run form, a run's live page, comparison, exports."""
import json

from django.contrib import messages
from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpResponse, HttpResponseForbidden
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from benchmarks import noise, payloads, runcommand, runrepeats, selectors, services
from benchmarks.forms import RunForm
from benchmarks.models import BenchmarkRun, Workload
from benchmarks.runner import slo as slos_mod
from deployments.models import Deployment
from plumbing.errors import ServiceError
from plumbing.params import ids_param, int_param
from plumbing.roles import is_operator, operator_required


def run_list(request):
    chosen = Deployment.objects.filter(pk=int_param(request.GET, "deployment") or 0).first()
    form = RunForm(initial={"deployment": chosen and chosen.pk,
                            "levels": ",".join(map(str, selectors.default_levels(chosen)))})
    if request.method == "POST":
        if not is_operator(request.user):
            return HttpResponseForbidden("Starting a benchmark needs the operator role.")
        form = RunForm(request.POST, request.FILES)
        if form.is_valid():
            data = form.cleaned_data
            try:
                run = services.run_create(params=form.params(), deployment=data["deployment"], base_url=data["base_url"],
                                          served_model=data["served_model"], name=data["name"], user=request.user)
                return redirect("run-detail", run.pk)
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
    runs = BenchmarkRun.objects.select_related("deployment")[:200]
    return render(request, "benchmarks/run_list.html", {"runs": runs, "form": form}, status=400 if form.errors else 200)


def run_detail(request, pk):
    run = get_object_or_404(BenchmarkRun.objects.select_related("deployment"), pk=pk)
    points = list(run.points.all())
    by_rate = bool(run.params.get("rates") or run.params.get("capacity")) and not run.params.get("levels")
    return render(request, "benchmarks/run_detail.html", {
        "run": run, "points": points, "environment": selectors.environment_rows(run.environment),
        "saturation": selectors.run_saturation(run, points), "late_sends": noise.late_sends(run, points),
        "prefix_rows": [(f"{p.rate:g} req/s" if p.kind == "rate" else f"concurrency {p.concurrency}",
                         p.server_metrics.get("prefix_cache"), p.prefix_reuse) for p in points
                        if p.server_metrics.get("prefix_cache") or p.prefix_reuse],
        # A run of rate levels only (or a capacity search) is charted against the rate; any other against concurrency.
        "axis": "rate" if by_rate else "concurrency", "axis_label": "request rate" if by_rate else "concurrency",
        "slo_text": slos_mod.describe(run.params.get("slos") or []), "commands": runcommand.commands(run),
        "repeats": run.over_repeats, "repeat_labels": runrepeats.LABELS,
        "workload_kind": dict(Workload.Kind.choices).get((run.params.get("workload") or {}).get("kind"), ""),
        "initial": {"ticks": run.ticks, "points": [payloads.run_point_data(p) for p in points],
                    "slos": run.params.get("slos") or []}})


@require_POST
@operator_required
def run_cancel(request, pk):
    try:
        services.run_cancel(get_object_or_404(BenchmarkRun, pk=pk))
        messages.success(request, "Cancelling; finished levels are kept.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("run-detail", pk)


def _ids(request) -> list[int]:
    name = "runs" if "runs" in request.GET else "ids"
    return ids_param(request.GET.getlist(name), name, limit=12)


def compare(request):
    runs = selectors.runs_with_points(_ids(request))
    diff = selectors.environment_diff(runs[0], runs[1]) if len(runs) >= 2 else []
    labels = selectors.run_labels(runs)
    for r in runs:
        r.label, r.startup_text = labels[r.pk], selectors.startup_text(r.environment)
    data = [{"id": r.pk, "name": r.name, "label": r.label, "single_stream_tok_s": r.single_stream_tok_s,
             "points": [payloads.run_point_data(p) for p in r.points.all()]} for r in runs]
    return render(request, "benchmarks/compare.html", {"runs": runs, "diff": diff, "data": data,
                                                       "ids": ",".join(str(r.pk) for r in runs), "slo_rows": _slo_rows(runs),
                                                       "energy_rows": _energy_rows(runs),
                                                       "deltas": noise.level_deltas(runs),
                                                       "repeat_deltas": runrepeats.compared_to_first(runs)})


def _slo_rows(runs) -> list[dict]:
    """Goodput and SLO attainment of each level of the compared runs that carried SLOs ([] when none did):
    one row per run and level, a capacity search's repeats apart."""
    rows = []
    for r in runs:
        if not r.params.get("slos"):
            continue
        for p in r.points.all():
            if p.goodput is not None:
                rows.append({"run": r, "slos": slos_mod.describe(r.params["slos"]), "point": p,
                             "label": f"{p.rate:g} req/s" if p.kind == "rate" else f"c={p.concurrency}"})
    return rows


def _energy_rows(runs) -> list[dict]:
    """Joules per output token of each level the compared runs measured energy for, gross and net of the GPUs' idle
    draw ([] when none did: CPU nodes)."""
    rows = []
    for r in runs:
        for p in r.points.all():
            if p.energy_j is not None and p.output_tokens:
                rows.append({"run": r, "point": p, "gross": p.energy_j / p.output_tokens,
                             "net": p.energy_net_j / p.output_tokens if p.energy_net_j is not None else None,
                             "label": f"{p.rate:g} req/s" if p.kind == "rate" else f"c={p.concurrency}"})
    return rows


def export(request, fmt, pk=None):
    if fmt not in ("csv", "json"):
        return HttpResponse("Export as .csv or .json.", status=404)
    ids = [pk] if pk else _ids(request)
    runs = selectors.runs_with_points(ids)
    if fmt == "json":
        response = HttpResponse(json.dumps(selectors.export_json(runs), cls=DjangoJSONEncoder, indent=1),
                                content_type="application/json")
    else:
        response = HttpResponse(selectors.export_csv(runs), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="benchmarks-{"-".join(map(str, ids))}.{fmt}"'
    return response
