from rest_framework import serializers

from benchmarks import runner, selectors
from benchmarks.models import BenchmarkPoint, BenchmarkRun
from deployments.models import Deployment

default = runner.spec_default


class BenchmarkPointSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkPoint
        exclude = ["run", "samples"]  # per-request figures: for studies' statistics, not for reading


class BenchmarkRunSerializer(serializers.ModelSerializer):
    class Meta:
        model = BenchmarkRun
        fields = ["id", "name", "deployment", "base_url", "served_model", "params", "status", "error", "environment",
                  "warnings", "single_stream_tok_s", "saturation", "created", "started", "finished"]

    saturation = serializers.SerializerMethodField(help_text=(
        'Where more concurrency stopped buying throughput, and why: {"level": 16 or null, "reason", "text"}; '
        "null before two levels are measured."))

    def get_saturation(self, run) -> dict | None:
        return selectors.run_saturation(run)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        data["params"] = {k: v for k, v in data["params"].items() if k != "prompts"}  # uploaded prompts can be large
        return data


class RunRequestSerializer(serializers.Serializer):
    """A sweep against a deployment (by id) or a URL; levels default to 1, 2, 4, … up to what the deployment
    runs at once (its --max-num-seqs; 64 on a CPU node), 1024 for a URL."""

    deployment = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.all(), required=False, allow_null=True)
    base_url = serializers.URLField(required=False, allow_blank=True, max_length=500)
    served_model = serializers.RegexField(r"^[\w./:@+-]*$", required=False, allow_blank=True, max_length=200, default="",
                                          error_messages={"invalid": "A model name: letters, digits and . / : @ + - _"})
    name = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    levels = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=4096), min_length=1, max_length=20,
                                   required=False)
    endpoint = serializers.ChoiceField(choices=[runner.CHAT, runner.COMPLETIONS], default=default("endpoint"))
    prompt_source = serializers.ChoiceField(choices=["builtin", "random", "jsonl"], default=default("prompt_source"))
    prompts_jsonl = serializers.CharField(required=False, allow_blank=True, max_length=20 * 2**20)
    input_tokens = serializers.IntegerField(min_value=1, max_value=200_000, default=default("input_tokens"))
    max_tokens = serializers.IntegerField(min_value=1, max_value=200_000, default=default("max_tokens"))
    ignore_eos = serializers.BooleanField(default=default("ignore_eos"))
    temperature = serializers.FloatField(min_value=0, max_value=2, default=default("temperature"))
    requests_per_user = serializers.IntegerField(min_value=1, max_value=1000, default=default("requests_per_user"))
    min_requests = serializers.IntegerField(min_value=1, max_value=100_000, default=default("min_requests"))
    warmup_per_user = serializers.IntegerField(min_value=0, max_value=100, default=default("warmup_per_user"))
    stop_when_saturated = serializers.BooleanField(default=default("stop_when_saturated"), help_text=(
        "End the sweep once a level shows the engine saturated (throughput flat while latency or the waiting "
        "queue climbs); false measures every level."))

    def validate(self, data):
        if bool(data.get("deployment")) == bool(data.get("base_url")):
            raise serializers.ValidationError({"deployment": ["Give a deployment or a base_url (not both)."]})
        if data["prompt_source"] == "jsonl":
            try:
                data["prompts"] = runner.load_jsonl(data.get("prompts_jsonl") or "", data["endpoint"])
            except runner.PromptError as exc:
                raise serializers.ValidationError({"prompts_jsonl": [str(exc)]}) from exc
        data.pop("prompts_jsonl", None)
        if not data.get("levels"):
            data["levels"] = selectors.default_levels(data.get("deployment"))
        return data
