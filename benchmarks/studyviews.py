"""Tuning study pages: the list with a new-study form (preview, then start), a study's
live page (matrix, verdicts, Pareto view, winner), its controls and the winner's apply."""
from django import forms
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from benchmarks import studies, studylevels, studyresults, workloads
from benchmarks.forms import parse_levels, parse_rates
from benchmarks.models import Study, StudyVariant, Workload
from deployments.models import Deployment
from plumbing.errors import ServiceError
from plumbing.roles import is_operator, operator_required


class StudyForm(forms.Form):
    deployment = forms.ModelChoiceField(queryset=Deployment.objects.filter(status__in=["ready", "stopped", "failed"]),
                                        help_text="Its settings now are the baseline.")
    name = forms.CharField(required=False, max_length=200)
    variants = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3, "placeholder": "max-num-seqs=16\nNCCL_PROTO=LL NCCL_ALGO=Ring"}),
                               help_text="One variant a line: NAME=VALUE pairs (upper case: environment, else engine flags).")
    dimensions = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2, "placeholder": "NCCL_PROTO=LL,LL128,Simple"}),
                                 help_text="One dimension a line: NAME=V1,V2,…; every combination is a variant.")
    levels = forms.CharField(initial="1,16", required=False, label="Concurrency levels",
                             help_text="Empty with request rates: rate levels only.")
    rates = forms.CharField(required=False, label="Request rates (req/s)",
                            help_text="Open-loop levels, e.g. 2,4,8, after the concurrency levels; each judged apart.")
    max_tokens = forms.IntegerField(min_value=1, max_value=200_000, initial=128)
    input_tokens = forms.IntegerField(min_value=1, max_value=200_000, initial=128)
    requests_per_user = forms.IntegerField(min_value=1, max_value=1000, initial=4)
    named_workload = forms.ModelChoiceField(queryset=Workload.objects.all(), required=False, label="Workload",
                                            empty_label="none: random prompts of the lengths above",
                                            help_text="A named workload's prompts and lengths, for every trial.")
    repeats = forms.IntegerField(min_value=1, max_value=studies.MAX_REPEATS, initial=3, help_text="Each variant this many times, interleaved: 3 or more for a verdict (fewer measure, "
                                                                                  "but are too few repeats to judge).")
    max_repeats = forms.IntegerField(min_value=0, max_value=studies.MAX_CAP, initial=0, required=False, label="Up to (adaptive)",
                                     help_text="Above the repeats: judged after them and after each round more, ended "
                                     "once every variant is decided or at this many. 0: the repeats, no more.")
    order = forms.ChoiceField(choices=list(studies.ORDERS.items()))
    rule = forms.ChoiceField(choices=list(studyresults.RULES.items()), initial="throughput", label="Winner rule")
    rule_level = forms.CharField(max_length=40, required=False, label="Rule's level N", help_text=(
        'One of the levels: a concurrency (16) or a rate ("4/s"). Default: the highest concurrency, else rate.'))
    ttft_p95_ms = forms.FloatField(min_value=0, required=False, label="TTFT p95 budget (ms)")
    finish_with = forms.ChoiceField(choices=[("baseline", "redeploy the baseline"), ("winner", "redeploy the winner")],
                                    label="At the end")

    def clean_levels(self):
        return parse_levels(self.cleaned_data["levels"])

    def clean_rates(self):
        return parse_rates(self.cleaned_data["rates"])

    def clean_rule_level(self):
        text = self.cleaned_data["rule_level"].strip()
        if text and studylevels.parse_level(text) is None:
            raise forms.ValidationError('A concurrency (16) or a request rate ("4/s").')
        return studylevels.parse_level(text) if text else None

    @staticmethod
    def _pairs(line: str) -> dict:
        out = {"engine_args": {}, "env": {}}
        for word in line.split():
            name, sep, value = word.partition("=")
            if not sep or not name:
                raise forms.ValidationError(f"{word[:40]!r}: write NAME=VALUE")
            if name.isupper():
                out["env"][name] = value
            else:
                out["engine_args"][name.lstrip("-")] = True if value == "" else _value(value)
        return out

    def clean(self):
        data = super().clean()
        try:
            variants = [{"name": "", **self._pairs(line)} for line in (data.get("variants") or "").splitlines() if line.strip()]
            dims = {}
            for line in (data.get("dimensions") or "").splitlines():
                if line.strip():
                    name, sep, values = line.strip().partition("=")
                    if not sep or not values:
                        raise forms.ValidationError(f"{line[:40]!r}: write NAME=V1,V2")
                    dims[name] = [v if name.isupper() else _value(v) for v in values.split(",")]
        except forms.ValidationError as exc:
            self.add_error("variants", exc)
            return data
        data["variant_list"] = studies.expand_variants(variants, dims)
        if not data["variant_list"]:
            self.add_error("variants", "Add at least one variant or dimension.")
        if data.get("rule") == "throughput_under_ttft" and data.get("ttft_p95_ms") is None:
            self.add_error("ttft_p95_ms", "Give the budget for this rule.")
        if "levels" in data and "rates" in data and not data["levels"] and not data["rates"]:
            self.add_error("levels", "Give concurrency levels, request rates, or both.")
        levels = studylevels.study_levels({"levels": data.get("levels"), "rates": data.get("rates")})
        if data.get("rule_level") is not None and "levels" in data and data["rule_level"] not in levels:
            self.add_error("rule_level", f"{studylevels.label(data['rule_level'])} is not one of the levels "
                                         f"({', '.join(studylevels.label(lv) for lv in levels) or 'none'}).")
        return data

    def create_args(self) -> dict:
        data = self.cleaned_data
        rule = {"kind": data["rule"]}
        if data.get("rule_level") is not None:
            rule["level"] = data["rule_level"]
        if data.get("ttft_p95_ms") is not None:
            rule["ttft_p95_ms"] = data["ttft_p95_ms"]
        return {"deployment": data["deployment"], "variants": data["variant_list"], "repeats": data["repeats"],
                "max_repeats": data.get("max_repeats") or 0, "order": data["order"], "rule": rule, "finish_with": data["finish_with"], "name": data["name"],
                "workload": self._workload()}

    def _workload(self) -> dict:
        data = self.cleaned_data
        workload = {"levels": data["levels"], "max_tokens": data["max_tokens"], "input_tokens": data["input_tokens"],
                    "requests_per_user": data["requests_per_user"]}
        if data["rates"]:  # as the API's workload: no rates key without rates
            workload["rates"] = data["rates"]
        return workloads.workload_params(data["named_workload"], workload) if data.get("named_workload") else workload


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return {"true": True, "false": False}.get(text.lower(), text)


def study_list(request):
    form, preview = StudyForm(), None
    if request.method == "POST":
        if not is_operator(request.user):
            return HttpResponse("Starting a study needs the operator role.", status=403)
        form = StudyForm(request.POST)
        if form.is_valid():
            args = form.create_args()
            try:
                if "preview" in request.POST:
                    studies.validate_variants(args["deployment"], args["variants"], request.user)
                    preview = studies.study_preview(args["deployment"], args["variants"], args["repeats"], args["workload"],
                                                    args["max_repeats"])
                    preview["names"] = ["baseline"] + [v["name"] for v in args["variants"]]
                else:
                    study = studies.study_create(**args, user=request.user)
                    return redirect("study-detail", study.pk)
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
    return render(request, "benchmarks/study_list.html", {
        "form": form, "preview": preview, "studies": Study.objects.select_related("deployment")[:200]},
        status=400 if form.errors else 200)


def study_detail(request, pk):
    study = get_object_or_404(Study.objects.select_related("deployment"), pk=pk)
    return render(request, "benchmarks/study_detail.html", {
        "study": study, "initial": studyresults.study_live(study),
        "rule_text": studyresults.rule_text(study.rule, studylevels.study_levels(study.workload))})


@require_POST
@operator_required
def study_control(request, pk, action):
    service = {"pause": studies.study_pause, "resume": studies.study_resume, "cancel": studies.study_cancel}.get(action)
    if service is None:
        return HttpResponse("No such action.", status=404)
    try:
        service(get_object_or_404(Study, pk=pk))
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("study-detail", pk)


@require_POST
@operator_required
def study_apply(request, pk):
    study = get_object_or_404(Study, pk=pk)
    level = studylevels.parse_level(request.POST.get("level", ""))
    if level is not None:  # the winner at a chosen level (a concurrency or a rate), in place of the variant picked
        chosen = studylevels.winner_at(study.results, level)
    else:
        chosen = request.POST.get("variant", "0") if str(request.POST.get("variant", "")).isdigit() else 0
    variant = StudyVariant.objects.filter(study=study, pk=chosen or 0).first()
    if variant is None:
        messages.error(request, f"The study has no winner at {studylevels.label(level)}." if level is not None
                       else "Choose a variant of this study.")
        return redirect("study-detail", pk)
    names = studyresults.debug_vars(variant)
    if names and request.POST.get("confirm_debug") != "on":
        messages.error(request, f"{variant.name} sets {', '.join(names)}, which NCCL's documentation lists for debugging, "
                                "not for production: tick the confirmation to apply it anyway.")
        return redirect("study-detail", pk)
    try:
        d = studies.study_apply(study, variant, user=request.user, persist=request.POST.get("persist") == "on")
        messages.success(request, f"Redeploying {d.name} with {variant.name}.")
        return redirect("deployment-detail", d.pk)
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("study-detail", pk)


def study_export(request, pk):
    study = get_object_or_404(Study, pk=pk)
    response = HttpResponse(studyresults.export_csv(study), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="study-{study.pk}.csv"'
    return response
