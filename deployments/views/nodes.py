"""Node pages: the dashboard, the node list, a node's page and its telemetry history (JSON)."""
import math
from datetime import timedelta

from django.http import JsonResponse
from django.shortcuts import get_object_or_404, render

from deployments import history, launcherstate, selectors
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
        "ranks": selectors.node_ranks(node), "agent_restart": launcherstate.agent_restart(node),
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
