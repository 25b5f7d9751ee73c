"""Deployment pages: the list, the deploy form (with presets), a deployment's live page, its actions
and its systemd unit."""
from django.contrib import messages
from django.db import transaction
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from rest_framework.utils import encoders

from deployments import (callit, deploydefaults, energy, exports, flagpolicy, forms, privileged, secrets, selectors, userflags,
                         versions)
from deployments.gateway import forms as gateway_forms, keys
from deployments.models import Deployment, ModelCopy, ModelRepo, Node, SleepProbe
from deployments.services import deploys, fitgate, multinode, rollbacks, sleeps
from deployments.views import recipes as recipe_pages
from plumbing.errors import ServiceError
from plumbing.params import int_param
from plumbing.roles import operator_required


def deployment_list(request):
    return render(request, "deployments/deployment_list.html", {"deployments": selectors.deployment_list()})


def _initial(preset: str | None, deployment: Deployment | None) -> dict:
    """Form values from a preset, or from an existing deployment (redeploy)."""
    if deployment:  # secrets are write-only: a masked value sent back keeps the stored one
        initial = deploydefaults.flags_initial(secrets.mask(deployment.engine_args),
                                               secrets.mask(deployment.env, secrets.marked(deployment)))
        initial.update({"name": deployment.name, "port": deployment.port,
                        "gpus": [str(i) for i in deployment.gpu_indices], "auto_restart": deployment.auto_restart,
                        "retry_advised": False,  # a change to a deployment retries only when asked
                        "stop_foreign": deployment.stop_foreign, "prewarm": deployment.prewarm,
                        "reuse_memory_profile": deployment.reuse_memory_profile, "sleep_mode": deployment.sleep_mode,
                        "start_asleep": deployment.start_asleep, "stall_seconds": deployment.stall_seconds})
        initial["secret_env"] = " ".join(secrets.marked(deployment))
        placed = deployment.ranks.select_related("node")  # multi-node: the worker nodes as placed, to keep or change
        initial["workers"] = [r.node.name for r in placed]
        initial["worker_gpus"] = " ".join(f"{r.node.name}={','.join(map(str, r.gpu_indices))}" for r in placed)
        return initial
    return deploydefaults.preset_initial(preset)


def _fit(model, node, form, deployment=None):
    """The fit estimate for what the form would deploy (its values, or its initial ones unchanged), and
    whether it stops the deploy: a "does not fit" an admin has not overridden for this deployment before."""
    checked = form if form.is_bound else forms.DeployForm(
        data=deploydefaults.submitted(form, keep=("gpus", "port", "workers")), node=node)
    if not checked.is_valid():
        return None, False
    data = checked.cleaned_data
    fit = fitgate.deploy_fit(model, node, data["gpu_indices"], data["engine_args"], data["env_vars"])
    if fit is None or fit.fits or not getattr(fit, "known", True) or data["placement"]:
        return fit, False
    earlier = deployment and deployment.events.filter(step="fit_override", data__verdict=fit.message).exists()
    return fit, not earlier


def _deploy_page(request, model, node, form, status=200, preset="", deployment=None, use=None, route_form=None):
    route_form = route_form or gateway_forms.RouteForm(prefix="route", initial=gateway_forms.route_initial(deployment))
    copies = {c.node_id: c for c in ModelCopy.objects.filter(model=model)}
    holders = list(node.deployments.filter(status__in=Deployment.ACTIVE)) if node else []
    fit, blocked = _fit(model, node, form, deployment)
    return render(request, "deployments/deploy.html", {
        "model": model, "node": node, "nodes": Node.objects.all(), "form": form, "presets": userflags.PRESETS,
        "preset": preset or request.GET.get("preset") or (node and userflags.node_preset(node.gpus.exists())),
        "privileged": privileged.FLAGS, "privileged_env": privileged.ENV,
        "operator_flags": flagpolicy.OPERATOR_FLAGS, "operator_env": flagpolicy.OPERATOR_ENV,
        "copy": copies.get(node.pk) if node else None, "holders": holders, "fit": fit, "fit_blocks": blocked,
        "fit_hint": fitgate.OVERRIDE_HINT, "override": form["override_fit"],
        **recipe_pages.deploy_context(model, node, form, use), "route_form": route_form}, status=status)


def _refused(form, exc: ServiceError) -> None:
    """A service's refusal on the field it names, else above the form (the override's own box is shown
    to admins only, so its refusal goes above the form too)."""
    shown = exc.field in form.fields and exc.field not in ("override_fit", "override_compat") and not form[exc.field].is_hidden
    form.add_error(exc.field if shown else None, exc.message)


def _workers(data) -> list[multinode.Worker]:
    return [multinode.Worker(node, gpus) for node, gpus in data["placement"]]


@operator_required
def deploy(request, pk):
    model = get_object_or_404(ModelRepo, pk=pk)
    node_id = int_param(request.GET, "node") or int_param(request.POST, "node_id")
    node = Node.objects.filter(pk=node_id or 0).first() or Node.objects.first()
    if node is None:
        messages.error(request, "No node yet: start a node agent first.")
        return redirect("model-detail", pk)
    if request.method != "POST":
        key = request.GET.get("preset", "")
        key = key if key in userflags.PRESETS else userflags.node_preset(node.gpus.exists())
        initial = {**_initial(key, None), "served_model_name": callit.served_name(model)}
        filled, use = recipe_pages.deploy_initial(request, model, node)  # ?recipe=&variant=&strategy=
        initial = filled or initial
        initial.setdefault("gpus", [str(g.index) for g in node.gpus.all()][: int(initial.get("tp") or 1)])
        initial["port"] = deploys.deployment_free_port(node)
        return _deploy_page(request, model, node, forms.DeployForm(node=node, initial=initial), preset=key, use=use)
    form = forms.DeployForm(request.POST, node=node)
    route_form = gateway_forms.RouteForm(request.POST, prefix="route", user=request.user)
    valid = form.is_valid() & route_form.is_valid()  # both: every error shows at once
    if not valid or "check" in request.POST:  # "Check fit": the estimate for these values, nothing deployed
        return _deploy_page(request, model, node, form, status=200 if valid else 400, route_form=route_form)
    data = form.cleaned_data
    try:
        with transaction.atomic():  # the route is saved before the plan is sent: the launch reads its media domains
            d = deploys.deployment_create(
                model=model, node=node, gpu_indices=data["gpu_indices"], port=data["port"], engine_args=data["engine_args"],
                env=data["env_vars"], secret_env=data["secret_names"], name=data["name"], replace_ids=data["replace_ids"], auto_restart=data["auto_restart"],
                stall_seconds=data["stall_seconds"], stop_foreign=data["stop_foreign"], prewarm=data["prewarm"], user=request.user,
                reuse_memory_profile=data["reuse_memory_profile"], retry_advised=data["retry_advised"],
                sleep_mode=data["sleep_mode"], start_asleep=data["start_asleep"],
                workers=_workers(data), master_port=data["master_port"], override_fit=data["override_fit"],
                **recipe_pages.deploy_kwargs(data))
            keys.route_set(d, user=request.user, **route_form.cleaned_data["route"])
    except ServiceError as exc:
        _refused(form, exc)
        return _deploy_page(request, model, node, form, status=409, route_form=route_form)
    return redirect("deployment-detail", d.pk)


def start_title(status: str) -> str:
    """The start-up card's title for a status (deployment.js writes the same as the status moves)."""
    return {Deployment.Status.READY: "Start-up", Deployment.Status.QUEUED: "Start-up (queued)",
            Deployment.Status.STOPPED: "Last start-up", Deployment.Status.FAILED: "Last start-up",
            Deployment.Status.STOPPING: "Last start-up"}.get(status, "Loading")


def deployment_detail(request, pk):
    d = get_object_or_404(selectors.deployment_list(), pk=pk)
    return render(request, "deployments/deployment_detail.html", {
        "deployment": d, "events": d.events.all(), "unit": selectors.deployment_unit(d)[1], "env": secrets.mask(d.env, secrets.marked(d)),
        "engine_args": secrets.mask(d.engine_args), "log_tail": secrets.redact_deployment(d, d.log_tail),
        "terminal": [str(s) for s in Deployment.TERMINAL], "call": callit.call(d), "command": selectors.deployment_command(d),
        "start_title": start_title(d.status), "starts": selectors.deployment_starts(d),
        "sleep_probe": (probe := SleepProbe.last_for(d) if d.sleep_mode else None),
        "swap_to": [] if probe and probe.verdict == SleepProbe.Verdict.FAILED else sleeps.swap_targets(d),
        "sleep_fit": sleeps.sleep_fit(d) if d.sleep_mode and d.status == Deployment.Status.READY else "",
        "versions": (listed := versions.listed(d)), "known_good": (good := next((v for v in listed if v["known_good"]), None)),
        "can_roll_back": bool(good) and d.status not in Deployment.IN_FLIGHT and (
            d.status == Deployment.Status.FAILED or good["number"] != listed[0]["number"]),
        "nodes": selectors.deployment_nodes(d) if d.master_port else [], "energy": energy.deployment_energy(d.pk)})


@operator_required
def deployment_edit(request, pk):
    """Redeploy with changed settings (same model and node)."""
    d = get_object_or_404(selectors.deployment_list(), pk=pk)
    if request.method != "POST":
        return _deploy_page(request, d.model, d.node, forms.DeployForm(node=d.node, initial=_initial(None, d)), deployment=d)
    form = forms.DeployForm(request.POST, node=d.node)
    route_form = gateway_forms.RouteForm(request.POST, prefix="route", user=request.user, deployment=d)
    valid = form.is_valid() & route_form.is_valid()
    if not valid or "check" in request.POST:
        return _deploy_page(request, d.model, d.node, form, status=200 if valid else 400, deployment=d, route_form=route_form)
    data = form.cleaned_data
    try:
        placement = {"workers": _workers(data)} if d.master_port or data["placement"] else {}
        with transaction.atomic():
            deploys.deployment_redeploy(d, gpu_indices=data["gpu_indices"], port=data["port"], engine_args=data["engine_args"],
                                         env=data["env_vars"], secret_env=data["secret_names"], auto_restart=data["auto_restart"], stall_seconds=data["stall_seconds"],
                                         stop_foreign=data["stop_foreign"], prewarm=data["prewarm"], user=request.user,
                                         reuse_memory_profile=data["reuse_memory_profile"], retry_advised=data["retry_advised"],
                                         sleep_mode=data["sleep_mode"], start_asleep=data["start_asleep"],
                                         override_fit=data["override_fit"], override_compat=data["override_compat"], **placement)
            keys.route_set(d, user=request.user, **route_form.cleaned_data["route"])
    except ServiceError as exc:
        _refused(form, exc)
        return _deploy_page(request, d.model, d.node, form, status=409, deployment=d, route_form=route_form)
    return redirect("deployment-detail", d.pk)


@require_POST
@operator_required
def deployment_action(request, pk, action):
    d = get_object_or_404(Deployment, pk=pk)
    if action == "delete":  # a stopped or failed one: failed deployments piled up with no way to remove them
        try:
            gone = deploys.deployment_delete(d)
        except ServiceError as exc:
            messages.error(request, exc.message)
            return redirect("deployment-detail", pk)
        messages.success(request, f"Deleted {d.name}." if gone else f"Deleting {d.name} once its node has removed its unit.")
        return redirect("deployment-list") if gone else redirect("deployment-detail", pk)
    act = {"stop": deploys.deployment_stop, "restart": deploys.deployment_redeploy, "persist": deploys.deployment_persist,
           "sleep": sleeps.deployment_sleep, "wake": sleeps.deployment_wake, "sleep-probe": sleeps.deployment_sleep_probe,
           "swap": lambda d: sleeps.deployment_swap(d, _swap_target(request)),
           "rollback": lambda d: rollbacks.deployment_rollback(d, _version_number(request), user=request.user)}
    if action not in act:
        raise Http404
    try:
        act[action](d)
        messages.success(request, {"stop": "Stopping", "restart": "Restarting", "persist": "Installing a systemd unit for",
                                   "sleep": "Putting to sleep", "wake": "Waking", "swap": "Swapping from",
                                   "sleep-probe": "Probing the sleep of", "rollback": "Rolling back"}[action]
                         + f" {d.name}.")
    except ServiceError as exc:
        messages.error(request, exc.message)
    return redirect("deployment-detail", pk)


def _version_number(request) -> int | None:
    number = request.POST.get("version", "")
    if not number:
        return None
    if not number.isdigit():
        raise ServiceError("Choose a version number.", field="version")
    return int(number)


def _swap_target(request) -> Deployment:
    try:
        return Deployment.objects.get(pk=int(request.POST.get("to", "")))
    except (ValueError, Deployment.DoesNotExist):
        raise ServiceError("Choose the deployment to swap to.", field="to") from None


def deployment_unit(request, pk):
    d = get_object_or_404(selectors.deployment_list(), pk=pk)
    name, text = selectors.deployment_unit(d)
    response = HttpResponse(text, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


def deployment_export(request, pk):
    """The API's export (deployments/exports.py) as a file, for the page's Export link."""
    d = get_object_or_404(selectors.deployment_list(), pk=pk)
    response = JsonResponse(exports.export(d), encoder=encoders.JSONEncoder,  # the API's: times to the microsecond
                            json_dumps_params={"indent": 2, "ensure_ascii": False})
    response["Content-Disposition"] = f'attachment; filename="{d.name}.json"'
    return response
