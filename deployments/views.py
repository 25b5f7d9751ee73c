"""Server-rendered pages. Views read through selectors and change things through services."""
import math
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.http import Http404, HttpResponseForbidden, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from controlpanel import tokens
from controlpanel.errors import ServiceError
from controlpanel.roles import is_operator, operator_required
from deployments import forms, history, selectors, services
from deployments.models import ModelCopy, ModelRepo, Node


def dashboard(request):
    nodes = list(selectors.node_list())
    return render(request, "deployments/dashboard.html", {"nodes": nodes})


def node_list(request):
    return render(request, "deployments/node_list.html", {"nodes": selectors.node_list()})


def node_detail(request, pk):
    node = get_object_or_404(selectors.node_list(), pk=pk)
    recent = history.recent(node.pk)
    return render(request, "deployments/node_detail.html", {
        "node": node, "gpus": node.gpus.all(), "recent": recent, "latest": recent[-1] if recent else None,
    })


def node_history(request, pk):
    """Chart data: full-rate samples after `since` (last hour), or per-minute rows for `days`."""
    node = get_object_or_404(Node, pk=pk)
    try:
        since = float(request.GET.get("since", 0))
        days = min(float(request.GET.get("days", 0)), 7.0)
    except ValueError:
        since = days = math.nan
    if not (math.isfinite(since) and math.isfinite(days)) or since < 0 or days < 0:  # "x", "nan", "inf", "-1"
        return JsonResponse({"error": "since and days must be finite numbers, 0 or more"}, status=400)
    if days:
        return JsonResponse({"resolution": 60, "samples": history.minutes(node.pk, timedelta(days=days))})
    return JsonResponse({"resolution": 1, "samples": history.recent(node.pk, since)})


def model_list(request):
    return render(request, "deployments/model_list.html", {
        "models": selectors.model_list(), "add_form": forms.ModelAddForm(), "local_form": forms.LocalModelForm()})


@require_POST
@operator_required
def model_add(request):
    form = forms.ModelAddForm(request.POST)
    if not form.is_valid():
        return render(request, "deployments/model_list.html", {
            "models": selectors.model_list(), "add_form": form, "local_form": forms.LocalModelForm()}, status=400)
    model = services.model_add(form.cleaned_data["repo_id"], form.cleaned_data["revision"] or "main")
    messages.success(request, f"Added {model}; reading its files and config from the Hub.")
    return redirect("model-detail", model.pk)


@require_POST
@operator_required
def model_add_local(request):
    form = forms.LocalModelForm(request.POST)
    if not form.is_valid():
        return render(request, "deployments/model_list.html", {
            "models": selectors.model_list(), "add_form": forms.ModelAddForm(), "local_form": form}, status=400)
    model = services.model_add_local(form.cleaned_data["node"], form.cleaned_data["path"])
    messages.success(request, f"Reading {form.cleaned_data['path']} on {form.cleaned_data['node']}.")
    return redirect("model-detail", model.pk)


def model_detail(request, pk, download_form=None, disk_short=None, status=200):
    model = get_object_or_404(selectors.model_list(), pk=pk)
    fit_form = forms.FitForm(request.GET or None)
    tp, kv = 8, "auto"
    if fit_form.is_valid():
        tp, kv = fit_form.cleaned_data["tp"], fit_form.cleaned_data["kv_cache_dtype"]
    fits = [(node, services.model_fit(model, node, tp, kv_cache_dtype=kv)) for node in Node.objects.prefetch_related("gpus")
            if node.gpus.all()]
    return render(request, "deployments/model_detail.html", {
        "model": model, "fits": fits, "fit_form": fit_form if fit_form.is_bound else forms.FitForm(),
        "download_form": download_form or forms.DownloadForm(), "disk_short": disk_short,
        "copies": model.copies.all(),
    }, status=status)


@require_POST
@operator_required
def model_download(request, pk):
    model = get_object_or_404(ModelRepo, pk=pk)
    form = forms.DownloadForm(request.POST)
    if not form.is_valid():
        return model_detail(request, pk, download_form=form, status=400)
    try:
        services.model_download(model, form.cleaned_data["node"])
    except services.DiskShort as short:
        return model_detail(request, pk, download_form=form, disk_short=short, status=409)
    except ServiceError as exc:
        form.add_error("node", exc.message)
        return model_detail(request, pk, download_form=form, status=409)
    messages.success(request, f"Downloading {model} to {form.cleaned_data['node']}.")
    return redirect("model-detail", pk)


@require_POST
@operator_required
def copy_action(request, pk, action):
    copy = get_object_or_404(ModelCopy.objects.select_related("model", "node"), pk=pk)
    act = {"cancel": services.model_copy_cancel, "retry": services.model_copy_retry, "delete": services.model_copy_delete}
    if action not in act:
        raise Http404
    try:
        act[action](copy)
        messages.success(request, f"{action.capitalize()}: {copy.model} on {copy.node}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    back = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()}, require_https=request.is_secure()):
        back = reverse("model-detail", args=[copy.model_id])  # never off-site: `next` came from the form
    return redirect(back)


def panel_settings(request):
    form = forms.HfTokenForm()
    if request.method == "POST":
        if not is_operator(request.user):
            return HttpResponseForbidden("Changing settings needs the operator role.")
        form = forms.HfTokenForm(request.POST)
        if form.is_valid():
            services.hf_token_set("" if form.cleaned_data["clear"] else form.cleaned_data["hf_token"])
            messages.success(request, "Hugging Face token saved." if form.cleaned_data["hf_token"] and not form.cleaned_data["clear"]
                             else "Hugging Face token cleared.")
            return redirect("settings")
    return render(request, "settings.html", {"form": form, "hf_token_set": bool(services.hf_token()),
                                             "hf_endpoint": settings.HF_ENDPOINT})


def deployment_list(request):
    return render(request, "deployments/deployment_list.html", {"deployments": selectors.deployment_list()})


def account(request):
    token = Token.objects.filter(user=request.user).first()
    return render(request, "account.html", {"has_token": token is not None})


@require_POST
def account_token(request):
    """Create (or replace) the user's API token; it is shown once."""
    Token.objects.filter(user=request.user).delete()
    if request.POST.get("action") == "revoke":
        messages.success(request, "API token revoked.")
        return redirect("account")
    return render(request, "account.html", {"has_token": True, "new_token": tokens.issue(request.user)})
