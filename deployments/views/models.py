"""Model pages: the model list (add from the Hub or a local folder), a model's page with its fit
estimates and copies, downloads and copy actions."""
from django.contrib import messages
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from deployments import forms, modelfit, selectors, warmstart
from deployments.models import ModelCopy, ModelRepo, Node
from deployments.services import fitgate, repos
from deployments.views import recipes as recipe_pages
from plumbing.errors import ServiceError
from plumbing.roles import operator_required


def model_list(request):
    return render(request, "deployments/model_list.html", {
        "models": selectors.model_list(), "add_form": forms.ModelAddForm(), "local_form": forms.LocalModelForm()})


def _to_the_list(request):
    """A GET of a form's POST address (a reload, a typed URL) lands on the form, not on a bare 405."""
    return redirect(reverse("model-list") + "#add-model")


def model_add(request):
    return _model_add(request) if request.method == "POST" else _to_the_list(request)


@operator_required
def _model_add(request):
    form = forms.ModelAddForm(request.POST)
    if not form.is_valid():
        return render(request, "deployments/model_list.html", {
            "models": selectors.model_list(), "add_form": form, "local_form": forms.LocalModelForm()}, status=400)
    try:
        model = repos.model_add(form.cleaned_data["repo_id"], form.cleaned_data["revision"] or "main")
    except ServiceError as exc:  # the hub does not know it: nothing was added
        form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        return render(request, "deployments/model_list.html", {
            "models": selectors.model_list(), "add_form": form, "local_form": forms.LocalModelForm()}, status=400)
    messages.success(request, f"Added {model}; reading its files and config from the Hub.")
    return redirect("model-detail", model.pk)


def model_add_local(request):
    return _model_add_local(request) if request.method == "POST" else _to_the_list(request)


@operator_required
def _model_add_local(request):
    form = forms.LocalModelForm(request.POST)
    if not form.is_valid():
        return render(request, "deployments/model_list.html", {
            "models": selectors.model_list(), "add_form": forms.ModelAddForm(), "local_form": form}, status=400)
    model = repos.model_add_local(form.cleaned_data["node"], form.cleaned_data["path"])
    messages.success(request, f"Reading {form.cleaned_data['path']} on {form.cleaned_data['node']}.")
    return redirect("model-detail", model.pk)


def model_detail(request, pk, download_form=None, disk_short=None, status=200):
    model = get_object_or_404(selectors.model_list(), pk=pk)
    nodes = list(Node.objects.prefetch_related("gpus"))
    # TP defaults to what the biggest node can run, not to 8 GPUs nobody has.
    most = max((len(n.gpus.all()) for n in nodes), default=0)
    tp_default = modelfit.default_tp(most)
    fit_form = forms.FitForm(request.GET or None, initial={"tp": tp_default})
    tp, kv = tp_default, "auto"
    if fit_form.is_valid():
        tp, kv = fit_form.cleaned_data["tp"], fit_form.cleaned_data["kv_cache_dtype"]
    fits = [(node, fitgate.model_fit(model, node, tp, kv_cache_dtype=kv)) for node in nodes]
    copies = list(model.copies.select_related("node"))
    for c in copies:
        c.file_rows = _file_rows(model, c)
        c.compile_cache = warmstart.cache_summary(c.node, model)
    return render(request, "deployments/model_detail.html", {
        "model": model, "fits": fits, "fit_form": fit_form, "tp": tp,
        "download_form": download_form or forms.DownloadForm(model=model), "disk_short": disk_short,
        "copies": copies, "disk": repos.model_disk_check(model, nodes), **recipe_pages.model_recipes(request, model, nodes),
    }, status=status)


def _file_rows(model, copy) -> list[dict]:
    """Each file of a copy with how much is there, and once the copy is ready, that it was verified
    (the live page writes the same as the download moves)."""
    got = (copy.progress or {}).get("files", {})
    rows = []
    for f in model.files:
        size = modelfit.human_bytes(f["size"])
        if copy.state == ModelCopy.State.READY:
            text = f"{size} · on the node's own disk" if model.local_path else f"{size} · verified"
        else:
            done = got.get(f["path"], [0, f["size"]])[0]
            text = f"{modelfit.human_bytes(done)} / {size}"
        rows.append({"path": f["path"], "text": text})
    return rows


@require_POST
@operator_required
def model_download(request, pk):
    model = get_object_or_404(ModelRepo, pk=pk)
    form = forms.DownloadForm(request.POST)  # every node: a refusal says why (already there, busy)
    if not form.is_valid():
        return model_detail(request, pk, download_form=form, status=400)
    try:
        repos.model_download(model, form.cleaned_data["node"])
    except repos.DiskShort as short:
        return model_detail(request, pk, download_form=form, disk_short=short, status=409)
    except ServiceError as exc:
        form.add_error("node", exc.message)
        return model_detail(request, pk, download_form=form, status=409)
    messages.success(request, f"Downloading {model} to {form.cleaned_data['node']}.")
    return redirect("model-detail", pk)


@require_POST
@operator_required
def model_remove(request, pk):
    model = get_object_or_404(ModelRepo, pk=pk)
    try:
        repos.model_remove(model)
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("model-detail", pk)
    messages.success(request, f"Removed {model}.")
    return redirect("model-list")


@require_POST
@operator_required
def copy_action(request, pk, action):
    copy = get_object_or_404(ModelCopy.objects.select_related("model", "node"), pk=pk)
    act = {"cancel": repos.model_copy_cancel, "retry": repos.model_copy_retry, "delete": repos.model_copy_delete}
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
