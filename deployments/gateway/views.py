"""Pages of the gateway's control plane: the account page's keys (create: the secret shown once; revoke) and the
Usage page (charts by hour or day per key, model name or deployment)."""
from django.contrib import messages
from django.http import HttpResponseForbidden
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from deployments.gateway import forms, keys, selectors
from deployments.gateway.models import CallerKey
from deployments.views.accountpage import account_context, account_keys
from plumbing.errors import ServiceError
from plumbing.roles import operator_required


def _account(request, status=200, **extra):
    return render(request, "account.html", {**account_context(request), **extra}, status=status)


@require_POST
@operator_required
def key_create(request):
    """Create a key; the page shows its secret this once."""
    form = forms.KeyForm(request.POST)
    if form.is_valid():
        try:
            key, secret = keys.key_create(request.user, form.cleaned_data["name"], **form.service_args())
        except ServiceError as exc:
            form.add_error(exc.field if exc.field in form.fields else None, exc.message)
        else:
            return _account(request, new_key=key, new_secret=secret)
    return _account(request, status=400, **account_keys(request.user, form))


@require_POST
@operator_required
def key_revoke(request, pk):
    key = get_object_or_404(CallerKey, pk=pk, internal=False)
    try:
        keys.key_revoke(key, request.user)
    except ServiceError as exc:
        if exc.code == "forbidden":
            return HttpResponseForbidden(exc.message)
        messages.error(request, exc.message)
    else:
        messages.success(request, f"Key {key.name} ({key.prefix}…) revoked: every gateway refuses it within a second.")
    return redirect("account")


def usage(request):
    """Usage by hour or day (?by=), per key, model name or deployment (?group=), over ?days= (charts + table)."""
    group = request.GET.get("group") if request.GET.get("group") in selectors.GROUPS else "key"
    by = request.GET.get("by") if request.GET.get("by") in selectors.BY else "hour"
    days = request.GET.get("days")
    try:
        rows = selectors.usage(group, by, days)
        error = ""
    except ServiceError as exc:
        rows, error, days = selectors.usage(group, by), exc.message, None
    labels = sorted({r["label"] for r in rows})
    totals = {label: {m: sum(r[m] for r in rows if r["label"] == label) for m in selectors.MEASURES} for label in labels}
    for label, t in totals.items():  # the energy shares: None unless some period of the label has one
        for m in selectors.ENERGY:
            known = [r[m] for r in rows if r["label"] == label and r[m] is not None]
            t[m] = round(sum(known), 1) if known else None
    # Every hour (or day) of the window, zero where nothing was used: a chart of the periods with data alone drew one
    # dot per key on an axis labelled 2027, 2028, 2029.
    periods = selectors.periods(by, days)
    data = {"by": by, "measures": list(selectors.MEASURES), "labels": labels,
            "periods": [int(p.timestamp()) for p in periods],
            "series": {m: {label: [0] * len(periods) for label in labels} for m in selectors.MEASURES}}
    index = {p: i for i, p in enumerate(periods)}
    for r in rows:
        for m in selectors.MEASURES:
            if r["period"] in index:  # always, by the window; a period outside it is not drawn rather than an error
                data["series"][m][r["label"]][index[r["period"]]] = r[m]
    return render(request, "gateway/usage.html", {
        "group": group, "by": by, "days": request.GET.get("days") or selectors.DEFAULT_DAYS[by], "error": error,
        "groups": list(selectors.GROUPS), "totals": totals, "measures": selectors.MEASURES, "data": data},
        status=400 if error else 200)
