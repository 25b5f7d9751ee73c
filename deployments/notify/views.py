"""The Notifications page: the user's channels (with a test button each), subscriptions, quiet hours, and the
delivery log of their channels. POSTs call one service each and come back here."""
import datetime as dt

from django.contrib import messages
from django.http import HttpResponseForbidden
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from deployments.models import Deployment, Node
from deployments.notify import catalog, services
from deployments.notify.models import Delivery, QuietHours, Slo
from plumbing import roles


def page(request):
    if not roles.is_viewer(request.user):
        return render(request, "no_role.html", status=403)
    user = request.user
    deliveries = (Delivery.objects.filter(channel__user=user).select_related("channel", "alert")
                  .prefetch_related("log").order_by("-created")[:50])
    return render(request, "notify/page.html", {
        "channels": user.notify_channels.all(), "subscriptions": user.notify_subscriptions.select_related("deployment", "node", "team"),
        "quiet": QuietHours.objects.filter(user=user).first(),
        "kinds": [catalog.KINDS[k] for k in catalog.SUBSCRIBABLE], "channel_kinds": services.Channel.Kind.choices,
        "deployments": Deployment.objects.order_by("name").only("id", "name"), "nodes": Node.objects.only("id", "name"),
        "teams": user.groups.all(),
        "deliveries": deliveries,
        "slos": Slo.objects.select_related("deployment").order_by("deployment__name"),
        "may_webhook": roles.is_admin(user), "may_operate": roles.is_operator(user),
        "new_key": request.session.pop("notify_new_key", None),
    })


def _id(value) -> int | None:
    return int(value) if str(value or "").isdigit() and len(str(value)) < 12 else None


def _int(value) -> int | None:
    """A whole number from a form field (blank: None)."""
    if value in (None, ""):
        return None
    if not str(value).lstrip("-").isdigit() or len(str(value)) > 9:
        raise services.NotifyError(f"{value!r} is not a whole number.")
    return int(value)


def _number(value) -> float | None:
    if value in (None, ""):
        return None
    try:
        number = float(value)
    except ValueError:
        raise services.NotifyError(f"{value!r} is not a number.") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise services.NotifyError(f"{value!r} is not a number.")
    return number


def _time(value) -> dt.time | None:
    try:
        return dt.time.fromisoformat(value) if value else None
    except ValueError:
        raise services.NotifyError(f"{value!r} is not a time (HH:MM).") from None


@require_POST
def action(request, what: str):
    """One change from the page: add/remove/test a channel, add/remove a subscription, set quiet hours."""
    if not roles.is_viewer(request.user):
        return render(request, "no_role.html", status=403)
    p, user = request.POST, request.user
    try:
        if what == "channel-add":
            channel, key = services.channel_add(user, p.get("kind", ""), p.get("name", ""), p.get("target", ""))
            if key:
                request.session["notify_new_key"] = key  # shown once, on the next page only
            messages.success(request, f"Channel {channel.name} added.")
        elif what == "channel-remove":
            services.channel_remove(user, _id(p.get("channel")))
            messages.success(request, "Channel removed.")
        elif what == "channel-test":
            services.channel_test(user, _id(p.get("channel")))
            messages.success(request, "Test message queued: its result shows in the delivery log below.")
        elif what == "subscription-add":
            services.subscription_add(user, p.getlist("kinds"), _id(p.get("deployment")), _id(p.get("node")),
                                      _id(p.get("team")))
            messages.success(request, "Subscribed.")
        elif what == "subscription-remove":
            services.subscription_remove(user, _id(p.get("subscription")))
            messages.success(request, "Subscription removed.")
        elif what == "quiet":
            services.quiet_hours_set(user, _time(p.get("start")), _time(p.get("end")), p.get("tz") or "UTC")
            messages.success(request, "Quiet hours saved.")
        elif what == "slo-set":
            slo = services.slo_set(user, _id(p.get("deployment")), _int(p.get("ttft_p95_ms")), _number(p.get("error_pct")),
                                   _int(p.get("minutes")) if p.get("minutes") else 5, _number(p.get("refused_pct")))
            messages.success(request, f"Objectives of {slo.deployment.name} saved.")
        elif what == "slo-remove":
            services.slo_remove(user, _id(p.get("deployment")))
            messages.success(request, "Objectives removed.")
        else:
            messages.error(request, f"Unknown action {what!r}.")
    except services.NotifyError as exc:
        if exc.forbidden:
            return HttpResponseForbidden(str(exc))
        messages.error(request, str(exc))
    return redirect("notify-page")


