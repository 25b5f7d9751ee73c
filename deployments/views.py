"""Server-rendered pages. Views read through selectors and change things through services."""
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from deployments import selectors


def dashboard(request):
    nodes = list(selectors.node_list())
    return render(request, "deployments/dashboard.html", {"nodes": nodes})


def node_list(request):
    return render(request, "deployments/node_list.html", {"nodes": selectors.node_list()})


def node_detail(request, pk):
    node = get_object_or_404(selectors.node_list(), pk=pk)
    return render(request, "deployments/node_detail.html", {"node": node, "gpus": node.gpus.all()})


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
