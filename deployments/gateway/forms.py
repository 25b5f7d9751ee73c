"""The account page's key form and the deploy form's gateway fields; the checks themselves are keys.py's, shared
with the API and panelctl."""
import re
from datetime import timedelta

from django import forms
from django.utils import timezone

from deployments.gateway import keys
from deployments.models import Deployment
from plumbing.errors import ServiceError


def words(text: str) -> list[str]:
    return [w for w in re.split(r"[\s,]+", text or "") if w]


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What it is for: a team, a script.")
    model_names = forms.CharField(required=False, max_length=4000, label="Model names",
                                  help_text="Space-separated served names or aliases, e.g. kimi qwen3; empty: any.")
    deployments = forms.ModelMultipleChoiceField(required=False, queryset=Deployment.objects.none(),
                                                 widget=forms.CheckboxSelectMultiple, help_text="None ticked: any.")
    expires_days = forms.IntegerField(required=False, min_value=1, max_value=3650, label="Expires after (days)",
                                      help_text="Empty: never.")
    rps_limit = forms.FloatField(required=False, min_value=0.001, max_value=keys.MAX_RPS, label="Requests / s")
    tpm_limit = forms.IntegerField(required=False, min_value=1, max_value=keys.MAX_TPM, label="Tokens / min")
    max_concurrency = forms.IntegerField(required=False, min_value=1, max_value=keys.MAX_CONCURRENCY,
                                         label="Concurrency")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["deployments"].queryset = Deployment.objects.filter(status__in=Deployment.ACTIVE).order_by("name")

    def clean_model_names(self):
        try:
            return keys.model_names_check(words(self.cleaned_data["model_names"]))
        except ServiceError as exc:
            raise forms.ValidationError(exc.message) from None

    def service_args(self) -> dict:
        data = self.cleaned_data
        days = data["expires_days"]
        return {"model_names": data["model_names"], "deployments": [d.pk for d in data["deployments"]],
                "expires_at": timezone.now() + timedelta(days=days) if days else None, "rps": data["rps_limit"],
                "tpm": data["tpm_limit"], "concurrency": data["max_concurrency"]}


class RouteForm(forms.Form):
    """The deploy form's gateway part: the names callers may use and the admission bounds (prefix `route`)."""

    aliases = forms.CharField(required=False, max_length=4000, label="Aliases",
                              help_text="More model names callers may use, e.g. kimi: the name follows a swap.")
    max_in_flight = forms.IntegerField(required=False, min_value=1, max_value=keys.MAX_IN_FLIGHT, label="Max in flight",
                                       help_text="Requests the gateway sends at once; empty: its --max-num-seqs.")
    queue_bound = forms.IntegerField(required=False, min_value=0, max_value=keys.MAX_QUEUE, initial=256,
                                     label="Queue bound", help_text="Requests waiting beyond that; then 429.")
    media_domains = forms.CharField(required=False, max_length=4000, label="Media domains",
                                    help_text="Host names image/audio/video URLs may come from, exactly (a subdomain is an entry of its own); "
                                              "empty: data: URLs only.")

    def __init__(self, *args, user=None, deployment=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.user, self.deployment = user, deployment

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            data["route"] = keys.route_check(aliases=words(data["aliases"]), max_in_flight=data["max_in_flight"],
                                             queue_bound=data["queue_bound"], media_domains=words(data["media_domains"]),
                                             user=self.user, deployment=self.deployment)
        except ServiceError as exc:
            self.add_error(exc.field if exc.field in self.fields else None, exc.message)
        return data


def route_initial(deployment) -> dict:
    route = getattr(deployment, "route", None) if deployment else None
    if route is None:
        return {"queue_bound": 256}
    return {"aliases": " ".join(route.names), "max_in_flight": route.max_in_flight, "queue_bound": route.queue_bound,
            "media_domains": " ".join(route.media_domains)}
