"""Named workloads' page: the list with each one's preview, a new-workload form (settings or a file) and delete."""
from django import forms
from django.contrib import messages
from django.http import HttpResponseForbidden
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from benchmarks import runner, workloads
from benchmarks.models import Workload
from plumbing.errors import ServiceError
from plumbing.roles import is_operator, operator_required


class WorkloadForm(forms.Form):
    name = forms.CharField(max_length=100)
    kind = forms.ChoiceField(choices=Workload.Kind.choices)
    prefixes = forms.IntegerField(required=False, help_text="Shared prefixes: how many (request i takes i mod K).")
    prefix_tokens = forms.IntegerField(required=False, help_text="Shared prefixes: tokens of each.")
    turns = forms.IntegerField(required=False, help_text="Multi-turn: turns per conversation.")
    think_s = forms.FloatField(required=False, label="Think time (s)", help_text="Multi-turn: wait after each answer "
                               "(an exponential think time's mean).")
    think = forms.ChoiceField(required=False, label="Think time drawn", choices=[
        ("fixed", "fixed"), ("exponential", "exponential (mean: think time)"), ("uniform", "uniform (min to max)")])
    think_min_s = forms.FloatField(required=False, label="Think min (s)", help_text="Multi-turn, uniform: the shortest.")
    think_max_s = forms.FloatField(required=False, label="Think max (s)", help_text="Multi-turn, uniform: the longest.")
    think_seed = forms.IntegerField(required=False, label="Think seed", help_text="Multi-turn: seeds the draws.")
    input_tokens = forms.IntegerField(initial=runner.spec_default("input_tokens"), help_text="Each suffix or user message.")
    max_tokens = forms.IntegerField(initial=runner.spec_default("max_tokens"), help_text="Each answer.")
    file = forms.FileField(required=False, help_text="ShareGPT (JSON or JSONL) or a Mooncake trace (JSONL), 20 MB at most.")


def workload_list(request):
    form = WorkloadForm()
    if request.method == "POST":
        if not is_operator(request.user):
            return HttpResponseForbidden("Saving a workload needs the operator role.")
        form = WorkloadForm(request.POST, request.FILES)
        if form.is_valid():
            data = dict(form.cleaned_data)
            upload = data.pop("file")
            values = {k: v for k, v in data.items() if k not in ("name", "kind") and v is not None}
            try:
                text = upload.read(workloads.MAX_FILE_BYTES + 1).decode("utf-8") if upload else ""
                w = workloads.workload_create(name=data["name"], kind=data["kind"], values=values, file_text=text,
                                              user=request.user)
                messages.success(request, f"Workload {w.name} saved.")
                return redirect("workload-list")
            except UnicodeDecodeError:
                form.add_error("file", "The file is not UTF-8 text.")
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
    return render(request, "benchmarks/workload_list.html", {"form": form, "workloads": Workload.objects.all()},
                  status=400 if form.errors else 200)


@require_POST
@operator_required
def workload_delete(request, pk):
    w = get_object_or_404(Workload, pk=pk)
    workloads.workload_delete(w)
    messages.success(request, f"Workload {w.name} deleted; runs that used it keep their copy.")
    return redirect("workload-list")
