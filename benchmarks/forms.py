"""The new-run form; the API serializer applies the same rules."""
from django import forms

from benchmarks import runner
from deployments.models import Deployment

MAX_LEVEL = 4096
default = runner.spec_default


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' or '1 8 64' -> [1, 2, 4, 8]; each level 1..4096, at most 20 levels."""
    try:
        levels = sorted({int(x) for x in text.replace(",", " ").split()})
    except ValueError:
        raise forms.ValidationError("Concurrency levels are whole numbers, e.g. 1,2,4,8,16") from None
    if not levels or len(levels) > 20 or levels[0] < 1 or levels[-1] > MAX_LEVEL:
        raise forms.ValidationError(f"Give 1 to 20 levels between 1 and {MAX_LEVEL}.")
    return levels


class RunForm(forms.Form):
    deployment = forms.ModelChoiceField(queryset=Deployment.objects.filter(status=Deployment.Status.READY), required=False,
                                        help_text="A ready deployment (the load runs on its node, next to the engine).")
    base_url = forms.URLField(required=False, max_length=500, label="…or any OpenAI-compatible URL", assume_scheme="http",
                              widget=forms.URLInput(attrs={"placeholder": "http://10.0.0.5:8000"}))
    served_model = forms.RegexField(r"^[\w./:@+-]*$", required=False, max_length=200, label="Model name",
                                   help_text="Default: the first model the server lists.")
    name = forms.CharField(required=False, max_length=200)
    levels = forms.CharField(initial=",".join(map(str, runner.DEFAULT_LEVELS)), label="Concurrency levels")
    endpoint = forms.ChoiceField(choices=[(runner.CHAT, "chat completions"), (runner.COMPLETIONS, "completions")],
                                 initial=default("endpoint"))
    prompt_source = forms.ChoiceField(choices=[("builtin", "built-in prompts"), ("random", "random prompts of a length"),
                                               ("jsonl", "uploaded JSONL")], initial=default("prompt_source"))
    prompts_file = forms.FileField(required=False, label="JSONL prompts", help_text='{"prompt": ...} or {"messages": [...]} per line')
    input_tokens = forms.IntegerField(min_value=1, max_value=200_000, initial=default("input_tokens"))
    max_tokens = forms.IntegerField(min_value=1, max_value=200_000, initial=default("max_tokens"))
    ignore_eos = forms.BooleanField(required=False, initial=default("ignore_eos"))
    temperature = forms.FloatField(min_value=0, max_value=2, initial=default("temperature"))
    requests_per_user = forms.IntegerField(
        min_value=1, max_value=1000, initial=default("requests_per_user"),
        help_text=f"Requests per level = max({default('min_requests')}, this × concurrency).")
    stop_when_saturated = forms.BooleanField(
        required=False, initial=default("stop_when_saturated"), label="Stop once the engine saturates",
        help_text="Skip the higher levels once throughput stays flat while latency or the engine's queue climbs.")

    def clean_levels(self):
        return parse_levels(self.cleaned_data["levels"])

    def clean(self):
        data = super().clean()
        if bool(data.get("deployment")) == bool(data.get("base_url")):
            raise forms.ValidationError("Choose a deployment or give a URL (not both).")
        if data.get("prompt_source") == "jsonl":
            upload = data.get("prompts_file")
            if not upload:
                self.add_error("prompts_file", "Upload a JSONL file of prompts.")
            elif upload.size > 20 * 2**20:
                self.add_error("prompts_file", "The file is over 20 MB.")
            else:
                try:
                    data["prompts"] = runner.load_jsonl(upload.read().decode("utf-8", errors="strict"), data["endpoint"])
                except (runner.PromptError, UnicodeDecodeError) as exc:
                    self.add_error("prompts_file", str(exc))
        return data

    def params(self) -> dict:
        data = self.cleaned_data
        keys = ("levels", "endpoint", "prompt_source", "input_tokens", "max_tokens", "ignore_eos", "temperature",
                "requests_per_user", "prompts", "stop_when_saturated")
        return {k: data[k] for k in keys if k in data}
