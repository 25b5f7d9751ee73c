"""The tuning studies API: operators create, pause, resume, cancel and apply; viewers watch."""
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from benchmarks import studies, studylevels, studyresults
from benchmarks.api.serializers import RunRequestSerializer
from benchmarks.models import Study
from deployments.models import Deployment
from plumbing.errors import ServiceError
from plumbing.idempotency import idempotent
from plumbing.params import DB_INT_MAX

MAX_VARIANTS = 50


class WorkloadSerializer(RunRequestSerializer):
    """The benchmark every trial runs: the fields of a run, without its target."""

    deployment = None
    base_url = None
    served_model = None
    name = None

    def validate(self, data):
        data["deployment"] = self.context.get("deployment")
        data["base_url"] = ""
        data = super().validate(data)
        for key in ("deployment", "base_url"):
            data.pop(key, None)
        return data


class VariantSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=120, required=False, allow_blank=True, default="")
    engine_args = serializers.DictField(required=False, default=dict,
                                        help_text='Flags to change, e.g. {"max-num-seqs": 16}; false removes a flag.')
    env = serializers.DictField(child=serializers.CharField(allow_blank=True, max_length=4096), required=False,
                                default=dict, help_text='Variables to change, e.g. {"NCCL_PROTO": "LL"}; "" removes one.')

    def validate_engine_args(self, value):
        if len(value) > 100:
            raise serializers.ValidationError("At most 100 engine flags.")
        return value


class RuleSerializer(serializers.Serializer):
    kind = serializers.ChoiceField(choices=list(studyresults.RULES), default="throughput")
    level = serializers.CharField(max_length=40, required=False, help_text=(
        'The level it judges at, one of the workload\'s: a concurrency (16) or a rate ("4/s"); default: the highest '
        "concurrency, else the highest rate."))
    ttft_p95_ms = serializers.FloatField(min_value=0, required=False)

    def validate_level(self, value):
        level = studylevels.parse_level(value)
        if level is None:
            raise serializers.ValidationError('A concurrency (16) or a request rate ("4/s").')
        return level

    def validate(self, data):
        if data["kind"] == "throughput_under_ttft" and "ttft_p95_ms" not in data:
            raise serializers.ValidationError({"ttft_p95_ms": ["Give the TTFT p95 budget in ms."]})
        return data


class StudyRequestSerializer(serializers.Serializer):
    """A study: the deployment as it is is the baseline; variants as a list and/or a product of dimensions."""

    deployment = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.select_related("node", "model"))
    name = serializers.CharField(required=False, allow_blank=True, max_length=200, default="")
    variants = VariantSerializer(many=True, required=False, default=list)
    dimensions = serializers.DictField(child=serializers.ListField(child=serializers.JSONField(), min_length=1, max_length=20),
                                       required=False, default=dict,
                                       help_text='{"NCCL_PROTO": ["LL", "LL128"], "max-num-seqs": [8, 16]}: every combination.')
    workload = serializers.DictField(required=False, default=dict, help_text="Levels, prompts, lengths (as for a run).")
    repeats = serializers.IntegerField(min_value=1, max_value=studies.MAX_REPEATS, default=3)
    max_repeats = serializers.IntegerField(min_value=0, max_value=studies.MAX_CAP, default=0, help_text=(
        "Adaptive when above repeats (which is then at least 3): judged after `repeats` and after each round more, at "
        "a sequential boundary that keeps false calls near 5 % over every look (Pocock's), and ended once every "
        "variant is decided on the rule's figure or after max_repeats (at most repeats + 9); 0: repeats, no more."))
    order = serializers.ChoiceField(choices=list(studies.ORDERS), default="interleaved")
    rule = RuleSerializer(required=False)
    finish_with = serializers.ChoiceField(choices=["baseline", "winner"], default="baseline")

    def validate(self, data):
        try:
            data["variants"] = studies.expand_variants(data.get("variants"), data.get("dimensions"))
        except TypeError as exc:
            raise serializers.ValidationError({"dimensions": [f"not a list of values: {exc}"]}) from exc
        data.pop("dimensions", None)
        if not data["variants"]:
            raise serializers.ValidationError({"variants": ["Add at least one variant (or dimension)."]})
        if len(data["variants"]) > MAX_VARIANTS:
            raise serializers.ValidationError({"variants": [f"{len(data['variants'])} variants: at most {MAX_VARIANTS}."]})
        for v in data["variants"]:
            for value in v["engine_args"].values():
                if value is not None and not isinstance(value, (str, int, float, bool)):
                    raise serializers.ValidationError({"variants": [f"{v['name']}: a flag's value is a string, number or true/false."]})
        workload = WorkloadSerializer(data=data.get("workload") or {}, context={"deployment": data["deployment"]})
        if not workload.is_valid():
            raise serializers.ValidationError({"workload": workload.errors})
        data["workload"] = dict(workload.validated_data)
        level = (data.get("rule") or {}).get("level")
        levels = studylevels.study_levels(data["workload"])
        if level is not None and level not in levels:  # the verdict would find no figures at it
            shown = ", ".join(studylevels.label(lv) for lv in levels) or "none"
            raise serializers.ValidationError({"rule": {"level": [
                f"{studylevels.label(level)} is not one of the workload's levels ({shown})."]}})
        return data


class StudySerializer(serializers.ModelSerializer):
    live = serializers.SerializerMethodField()

    class Meta:
        model = Study
        fields = ["id", "name", "deployment", "status", "error", "repeats", "max_repeats", "order", "workload",
                  "base_engine_args",
                  "base_env", "rule", "rule_text", "finish_with", "estimate_s", "estimate_basis", "took_s", "created",
                  "started", "finished", "live"]

    rule_text = serializers.SerializerMethodField(help_text="How the winner is chosen, in words.")
    took_s = serializers.SerializerMethodField(help_text="Seconds from start to end, once ended (against estimate_s).")

    def get_live(self, study) -> dict:
        return studyresults.study_live(study)

    def get_rule_text(self, study) -> str:
        return studyresults.rule_text(study.rule, studylevels.study_levels(study.workload))

    def get_took_s(self, study) -> float | None:
        return studyresults.took_s(study)

    def to_representation(self, instance):
        data = super().to_representation(instance)
        # Uploaded prompts and a named workload's data are large: the workload is shown by its name.
        data["workload"] = {k: v for k, v in data["workload"].items() if k not in ("prompts", "workload")}
        return data


class StudyListSerializer(StudySerializer):
    class Meta(StudySerializer.Meta):
        fields = [f for f in StudySerializer.Meta.fields if f != "live"]


class ApplySerializer(serializers.Serializer):
    variant = serializers.IntegerField(min_value=1, max_value=DB_INT_MAX, required=False, help_text=(
        "Default: the winner at `level` when given, else the study's winner."))
    level = serializers.CharField(max_length=40, required=False, help_text=(
        'Apply the variant that wins at this level (results.per_level): a concurrency (16) or a rate ("4/s").'))

    def validate_level(self, value):
        if studylevels.parse_level(value) is None:
            raise serializers.ValidationError('A concurrency (16) or a request rate ("4/s").')
        return studylevels.parse_level(value)
    persist = serializers.BooleanField(default=False, help_text="Also install it as a systemd service once it runs.")
    confirm_debug = serializers.BooleanField(default=False, help_text=(
        "The variant sets NCCL variables NCCL's documentation lists for debugging only: apply anyway."))


class StudyViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    lookup_value_regex = r"[0-9]+"
    queryset = Study.objects.select_related("deployment")

    def get_serializer_class(self):
        return StudyListSerializer if self.action == "list" else StudySerializer

    def _create_args(self, request) -> dict:
        body = StudyRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return dict(body.validated_data)

    @extend_schema(request=StudyRequestSerializer, responses={202: StudySerializer})
    @idempotent
    def create(self, request):
        """Start a study; follow it with GET /api/studies/{id}/ (or its page, live)."""
        v = self._create_args(request)
        rule = dict(v["rule"]) if v.get("rule") else None
        study = studies.study_create(deployment=v["deployment"], variants=v["variants"], workload=v["workload"],
                                     repeats=v["repeats"], order=v["order"], rule=rule, finish_with=v["finish_with"],
                                     name=v["name"], user=request.user, max_repeats=v["max_repeats"])
        return Response(StudySerializer(study).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=StudyRequestSerializer, responses=dict)
    @action(detail=False, methods=["post"])
    def preview(self, request):
        """How many variants and trials a study would run and its estimated duration; starts nothing."""
        v = self._create_args(request)
        studies.validate_variants(v["deployment"], v["variants"], request.user)
        preview = studies.study_preview(v["deployment"], v["variants"], v["repeats"], v["workload"], v["max_repeats"])
        preview["names"] = ["baseline"] + [x["name"] for x in v["variants"]]
        return Response(preview)

    def _control(self, request, service):
        study = service(self.get_object())
        return Response(StudySerializer(study).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: StudySerializer})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        """Pause after the trial in progress."""
        return self._control(request, studies.study_pause)

    @extend_schema(request=None, responses={202: StudySerializer})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        """Continue a paused study."""
        return self._control(request, studies.study_resume)

    @extend_schema(request=None, responses={202: StudySerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel: the run in progress stops, finished trials stay, the baseline is redeployed."""
        return self._control(request, studies.study_cancel)

    @extend_schema(request=ApplySerializer, responses={202: dict})
    @action(detail=True, methods=["post"])
    @idempotent
    def apply(self, request, pk=None):
        """Redeploy the deployment with a variant's settings (the winner by default)."""
        study = self.get_object()
        body = ApplySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        v = body.validated_data
        if v.get("level") and not v.get("variant") and studylevels.winner_at(study.results, v["level"]) is None:
            raise ServiceError(f"The study has no winner at {studylevels.label(v['level'])}.".replace("at c=", "at concurrency "),
                               field="level")
        variant_id = (v.get("variant") or (studylevels.winner_at(study.results, v["level"]) if v.get("level") else None)
                      or (study.results or {}).get("winner"))
        variant = study.variants.filter(pk=variant_id).first() if variant_id else None
        if variant is None:
            raise ServiceError("No such variant in this study (and no winner to apply).", field="variant")
        names = studyresults.debug_vars(variant)
        if names and not v["confirm_debug"]:
            raise ServiceError(f"{variant.name} sets {', '.join(names)}, which NCCL's documentation lists for debugging, "
                               "not for production: confirm to apply it anyway.", field="confirm_debug", code="confirm")
        d = studies.study_apply(study, variant, user=request.user, persist=v["persist"])
        return Response({"deployment": d.pk, "status": d.status, "variant": variant.pk, "name": variant.name},
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[OpenApiParameter("as", str, enum=["json", "csv"])], responses=dict)
    @action(detail=True)
    def export(self, request, pk=None):
        """Every trial's levels as CSV (`?as=csv`), or the study with its results as JSON."""
        study = self.get_object()
        if request.query_params.get("as") == "csv":
            return HttpResponse(studyresults.export_csv(study), content_type="text/csv")
        return Response(StudySerializer(study).data)
