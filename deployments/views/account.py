"""The user's own pages: the account page and its API token, and the panel settings (Hugging Face token)."""
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import update_session_auth_hash
from django.contrib.auth.forms import PasswordChangeForm
from django.http import HttpResponseForbidden
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from deployments import forms, modelcopies
from deployments.services import repos
from deployments.views.accountpage import account_context
from plumbing import tokens
from plumbing.roles import is_operator


def panel_settings(request):
    form = forms.HfTokenForm()
    if request.method == "POST":
        if not is_operator(request.user):
            return HttpResponseForbidden("Changing settings needs the operator role.")
        form = forms.HfTokenForm(request.POST)
        if form.is_valid():
            repos.hf_token_set("" if form.cleaned_data["clear"] else form.cleaned_data["hf_token"])
            messages.success(request, "Hugging Face token saved." if form.cleaned_data["hf_token"] and not form.cleaned_data["clear"]
                             else "Hugging Face token cleared.")
            return redirect("settings")
    return render(request, "settings.html", {"form": form, "hf_token_set": bool(modelcopies.hf_token()),
                                             "hf_endpoint": settings.HF_ENDPOINT})


def account(request):
    """The account page; a POST changes the user's own password (old one first), keeping this session."""
    form = PasswordChangeForm(request.user, request.POST or None)
    if request.method == "POST" and form.is_valid():
        update_session_auth_hash(request, form.save())
        messages.success(request, "Password changed.")
        return redirect("account")
    return render(request, "account.html", account_context(request, form), status=400 if form.is_bound else 200)


@require_POST
def account_token(request):
    """Create (or replace) the user's API token; it is shown once."""
    Token.objects.filter(user=request.user).delete()
    if request.POST.get("action") == "revoke":
        messages.success(request, "API token revoked.")
        return redirect("account")
    new_token = tokens.issue(request.user)
    return render(request, "account.html", {**account_context(request), "new_token": new_token})
