"""The new-run form; the API serializer applies the same rules."""
from django import forms

from benchmarks import runner, workloads
from benchmarks.models import Workload
from benchmarks.runner import capacity as capacity_search, slo as slo_mod
from deployments.models import Deployment

MAX_LEVEL = 4096
MAX_RATE = 10_000.0  # requests/s: the runner keeps its schedule to 1,000/s on a small box (perf/rate_schedule.py)
MAX_BURSTINESS = 100.0
default = runner.spec_default


def rates_problem(rates: list[float]) -> str:
    """Why these request rates cannot run ("" if they can): each above 0 and at most MAX_RATE, at most 20."""
    if len(rates) > 20:
        return "Give at most 20 request rates."
    for rate in rates:
        if not rate > 0:
            return f"A request rate is requests per second above 0 (got {rate:g}), e.g. 2,4,8."
        if rate > MAX_RATE:
            return f"A request rate of {rate:g}/s is more than the {MAX_RATE:,.0f} requests/s a rate level may ask."
    return ""


def ramp_problem(ramp: str, ramp_from: float) -> str:
    """Why a ramp cannot run ("" if it can): an exponential ramp starts above 0."""
    if ramp == "exponential" and not ramp_from > 0:
        return "An exponential ramp starts above 0 requests/s: give ramp_from."
    if ramp_from < 0 or ramp_from > MAX_RATE:
        return f"ramp_from is requests per second between 0 and {MAX_RATE:,.0f}."
    return ""


def parse_rates(text: str) -> list[float]:
    """'2,4,8' or '0.5 1' -> [0.5, 1.0]; '' -> []."""
    try:
        rates = sorted({float(x) for x in text.replace(",", " ").split()})
    except ValueError:
        raise forms.ValidationError("Request rates are numbers of requests per second, e.g. 2,4,8") from None
    if problem := rates_problem(rates):
        raise forms.ValidationError(problem)
    return rates


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' or '1 8 64' -> [1, 2, 4, 8]; each level 1..4096, at most 20 levels; '' -> [] (rates only)."""
    if not text.strip():
        return []
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
    levels = forms.CharField(initial=",".join(map(str, runner.DEFAULT_LEVELS)), label="Concurrency levels", required=False,
                             help_text="Empty with request rates: rate levels only.")
    rates = forms.CharField(required=False, label="Request rates (req/s)", help_text=(
        "Open-loop levels after the concurrency levels, e.g. 2,4,8: Poisson arrivals (or gamma with a burstiness)."))
    burstiness = forms.FloatField(min_value=0.01, max_value=MAX_BURSTINESS, initial=default("burstiness"), required=False, help_text=(
        "Gamma shape of the gaps between requests: 1 is Poisson, below 1 burstier."))
    max_concurrency = forms.IntegerField(min_value=0, max_value=MAX_LEVEL, initial=default("max_concurrency"),
                                         required=False, label="Max concurrency at a rate", help_text="0: no cap.")
    ramp = forms.ChoiceField(choices=[("", "none"), ("linear", "linear"), ("exponential", "exponential")], required=False)
    ramp_from = forms.FloatField(min_value=0, max_value=MAX_RATE, initial=default("ramp_from"), required=False,
                                 label="Ramp from (req/s)")
    endpoint = forms.ChoiceField(choices=[(runner.CHAT, "chat completions"), (runner.COMPLETIONS, "completions")],
                                 initial=default("endpoint"))
    prompt_source = forms.ChoiceField(choices=[("builtin", "built-in prompts"), ("random", "random prompts of a length"),
                                               ("jsonl", "uploaded JSONL")], initial=default("prompt_source"))
    workload = forms.ModelChoiceField(queryset=Workload.objects.all(), required=False, empty_label="none: the prompts above",
                                      help_text="A named workload's prompts and lengths (they replace the prompt fields); "
                                      "a trace with no levels or rates replays at its own rate.")
    prompts_file = forms.FileField(required=False, label="JSONL prompts", help_text='{"prompt": ...} or {"messages": [...]} per line')
    input_tokens = forms.IntegerField(min_value=1, max_value=200_000, initial=default("input_tokens"))
    max_tokens = forms.IntegerField(min_value=1, max_value=200_000, initial=default("max_tokens"))
    ignore_eos = forms.BooleanField(required=False, initial=default("ignore_eos"))
    temperature = forms.FloatField(min_value=0, max_value=2, initial=default("temperature"))
    requests_per_user = forms.IntegerField(
        min_value=1, max_value=1000, initial=default("requests_per_user"),
        help_text=f"Requests per level = max({default('min_requests')}, this × concurrency).")
    request_timeout_s = forms.FloatField(required=False, label="Request timeout (s)", help_text=(
        "How long each request may take. Empty: its own, from its max_tokens (a slow stream at high concurrency "
        "still finishes)."))
    stop_when_saturated = forms.BooleanField(
        required=False, initial=default("stop_when_saturated"), label="Stop once the engine saturates",
        help_text="Skip the higher levels once throughput stays flat while latency or the engine's queue climbs.")
    repeats = forms.IntegerField(min_value=1, max_value=runner.MAX_REPEATS, initial=default("repeats"), required=False,
                                 label="Repeats per level", help_text=(
        "Measure each level this many times (each with prompts of its own): every figure then shows its median "
        "with a 95 % interval (from 3 repeats), and a comparison says which differences are beyond the noise."))
    slos = forms.CharField(required=False, max_length=300, label="SLOs", widget=forms.TextInput(
        attrs={"placeholder": "ttft:p99:2s, itl:p95:50ms"}), help_text=(
        "metric:percentile:limit (ttft, itl, e2e); each level then reports goodput and attainment."))
    capacity_low = forms.FloatField(min_value=0, max_value=MAX_RATE, required=False, label="Capacity search from (req/s)")
    capacity_high = forms.FloatField(min_value=0, max_value=MAX_RATE, required=False, label="to (req/s)", help_text=(
        "Find the highest rate meeting the SLOs by bisection (instead of, or after, the levels and rates)."))
    capacity_width = forms.FloatField(min_value=0, required=False, label="within (req/s)", help_text="0: (to − from) ÷ 64.")
    capacity_repeats = forms.IntegerField(min_value=1, max_value=5, initial=1, required=False, label="repeats per rate")

    def clean_levels(self):
        return parse_levels(self.cleaned_data["levels"])

    def clean_rates(self):
        return parse_rates(self.cleaned_data["rates"])

    def clean_request_timeout_s(self):
        if problem := runner.timeout_problem(self.cleaned_data["request_timeout_s"]):
            raise forms.ValidationError(problem)
        return self.cleaned_data["request_timeout_s"]

    def clean_slos(self):
        try:
            return slo_mod.parse(self.cleaned_data["slos"])
        except runner.RunnerError as exc:
            raise forms.ValidationError(exc.message) from None

    def _capacity(self, data: dict) -> dict:
        """The capacity search asked for ({} for none), checked; errors go on its fields."""
        if data.get("capacity_high") is None:
            return {}
        search = {"low": data.get("capacity_low") or 0.0, "high": data["capacity_high"],
                  "width": data.get("capacity_width") or 0.0, "repeats": data.get("capacity_repeats") or 1}
        if not data.get("slos"):
            self.add_error("slos", "A capacity search needs SLOs to meet, e.g. ttft:p99:2s.")
            return {}
        try:
            return capacity_search.check(search)
        except runner.RunnerError as exc:
            self.add_error("capacity_high", exc.message)
            return {}

    def clean(self):
        data = super().clean()
        for name in ("burstiness", "max_concurrency"):  # left empty (a script posting only rates): the runner's own
            if name in data and data[name] is None:
                data[name] = default(name)
        if bool(data.get("deployment")) == bool(data.get("base_url")):
            raise forms.ValidationError("Choose a deployment or give a URL (not both).")
        trace = data.get("workload") is not None and data["workload"].kind == Workload.Kind.TRACE
        data["capacity"] = self._capacity(data)
        if ("levels" in data and "rates" in data and not data["levels"] and not data["rates"] and not trace
                and not data["capacity"] and data.get("capacity_high") is None):
            self.add_error("levels", "Give concurrency levels, request rates, or both.")
        if problem := ramp_problem(data.get("ramp") or "", data.get("ramp_from") or 0.0):
            self.add_error("ramp_from", problem)
        if data.get("prompt_source") == "jsonl" and not data.get("workload"):
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
                "requests_per_user", "prompts", "stop_when_saturated", "request_timeout_s")
        params = {k: data[k] for k in keys if k in data}
        params["repeats"] = data.get("repeats") or default("repeats")
        params.update({k: data[k] for k in ("slos", "capacity") if data.get(k)})
        if data.get("rates") or data.get("capacity"):
            params.update(rates=data.get("rates") or [], burstiness=data["burstiness"], max_concurrency=data["max_concurrency"],
                          arrival="poisson" if data["burstiness"] == 1 else "gamma", ramp=data.get("ramp") or "",
                          ramp_from=data.get("ramp_from") or 0.0)
        if data.get("workload") is not None:  # ServiceError (a multi-turn workload at rates) for the view to show
            params = workloads.workload_params(data["workload"], params)
        return params
