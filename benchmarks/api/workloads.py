"""Named workloads: operators create and delete them, anyone may read them and their previews."""
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from benchmarks import workloads
from benchmarks.models import Workload
from plumbing.idempotency import idempotent


class WorkloadSerializer(serializers.ModelSerializer):
    """A workload as it is read: its settings and preview, without its file's data."""

    settings = serializers.SerializerMethodField(help_text="The kind's own settings (prefixes, turns, think_s, ...).")

    class Meta:
        model = Workload
        fields = ["id", "name", "kind", "settings", "input_tokens", "max_tokens", "preview", "created"]

    def get_settings(self, workload) -> dict:
        return {k: v for k, v in workload.spec.items() if k not in ("kind", "entries", "requests")}


class WorkloadRequestSerializer(serializers.Serializer):
    """A new workload: shared prefixes (prefixes, prefix_tokens), multi-turn (turns, think_s), or a file: a
    ShareGPT JSON/JSONL, or a Mooncake trace (JSONL of timestamp, input_length, output_length, hash_ids)."""

    name = serializers.CharField(max_length=100)
    kind = serializers.ChoiceField(choices=Workload.Kind.choices)
    prefixes = serializers.IntegerField(required=False, help_text="Shared prefixes: how many (request i takes i mod K).")
    prefix_tokens = serializers.IntegerField(required=False, help_text="Shared prefixes: tokens of each.")
    turns = serializers.IntegerField(required=False, help_text="Multi-turn: turns per conversation.")
    think_s = serializers.FloatField(required=False, help_text=(
        "Multi-turn: seconds a user waits after an answer (the mean of an exponential think time)."))
    think = serializers.ChoiceField(choices=["fixed", "exponential", "uniform"], required=False, help_text=(
        "Multi-turn: the think time is think_s (fixed), an exponential draw of mean think_s, or uniform in "
        "think_min_s..think_max_s; draws are seeded by think_seed."))
    think_min_s = serializers.FloatField(required=False, help_text="Multi-turn, uniform think time: the shortest.")
    think_max_s = serializers.FloatField(required=False, help_text="Multi-turn, uniform think time: the longest.")
    think_seed = serializers.IntegerField(required=False, help_text="Multi-turn: seeds the think-time draws (default 0).")
    input_tokens = serializers.IntegerField(required=False, help_text="Each suffix, or each user message.")
    max_tokens = serializers.IntegerField(required=False, help_text="Each answer (and made-up reply in the history).")
    file = serializers.CharField(required=False, allow_blank=True, max_length=workloads.MAX_FILE_BYTES, trim_whitespace=False,
                                 help_text="The ShareGPT or trace file's text.")


class WorkloadViewSet(mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    lookup_value_regex = r"[0-9]+"
    serializer_class = WorkloadSerializer
    queryset = Workload.objects.all()

    @extend_schema(request=WorkloadRequestSerializer, responses={201: WorkloadSerializer})
    @idempotent
    def create(self, request):
        """Check a workload (a malformed file is refused naming the line and the field) and keep it with its preview."""
        body = WorkloadRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        v = dict(body.validated_data)
        workload = workloads.workload_create(name=v.pop("name"), kind=v.pop("kind"), file_text=v.pop("file", ""),
                                             values=v, user=request.user)
        return Response(WorkloadSerializer(workload).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        workloads.workload_delete(instance)
