"""Server-rendered pages. Views read through selectors and change things through services."""
from datetime import timedelta

from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from deployments import history, selectors
from deployments.models import Node


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
        return JsonResponse({"error": "since and days must be numbers"}, status=400)
    if days:
        return JsonResponse({"resolution": 60, "samples": history.minutes(node.pk, timedelta(days=days))})
    return JsonResponse({"resolution": 1, "samples": history.recent(node.pk, since)})


def model_list(request):
    return render(request, "deployments/model_list.html", {"models": selectors.model_list()})


def model_detail(request, pk):
    model = get_object_or_404(selectors.model_list(), pk=pk)
    return render(request, "deployments/model_detail.html", {"model": model})


def deployment_list(request):
    return render(request, "deployments/deployment_list.html", {"deployments": selectors.deployment_list()})


def deployment_detail(request, pk):
    deployment = get_object_or_404(selectors.deployment_list(), pk=pk)
    return render(
        request,
        "deployments/deployment_detail.html",
        {"deployment": deployment, "events": deployment.events.all()},
    )


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
    token = Token.objects.create(user=request.user)
    return render(request, "account.html", {"has_token": True, "new_token": token.key})
