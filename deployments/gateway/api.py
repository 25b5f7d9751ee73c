"""REST API of the gateway's control plane: /api/keys/ (callers' keys: the secret in the create answer only) and
/api/usage/ (sums by hour or day per key, model name or deployment; ?format=csv for a spreadsheet)."""
from django.http import HttpResponse
from django.urls import path
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter
from rest_framework.views import APIView

from deployments.gateway import keys, selectors
from deployments.gateway.models import CallerKey
from plumbing.idempotency import idempotent
from plumbing.params import int_param


class KeySerializer(serializers.ModelSerializer):
    owner = serializers.SlugRelatedField(slug_field="username", read_only=True)
    deployments = serializers.SerializerMethodField()
    usage = serializers.SerializerMethodField(help_text="All-time sums of the key's usage.")
    revoked = serializers.SerializerMethodField()

    class Meta:
        model = CallerKey
        fields = ["id", "name", "prefix", "owner", "model_names", "deployments", "expires_at", "rps_limit", "tpm_limit",
                  "max_concurrency", "created", "last_used_at", "revoked", "revoked_at", "usage"]

    def get_deployments(self, obj) -> list[int]:
        return [d.pk for d in obj.deployments.all()]

    def get_revoked(self, obj) -> bool:
        return obj.revoked_at is not None

    def get_usage(self, obj) -> dict:
        return {m: getattr(obj, f"used_{m}", None) or 0 for m in selectors.MEASURES}


class KeyCreatedSerializer(KeySerializer):
    secret = serializers.CharField(read_only=True, help_text="The key itself: shown in this answer only.")

    class Meta(KeySerializer.Meta):
        fields = KeySerializer.Meta.fields + ["secret"]


class KeyScopeSerializer(serializers.Serializer):
    """Scope, expiry and limits; empty scopes allow every model name and deployment, null limits none."""

    model_names = serializers.ListField(child=serializers.CharField(max_length=200, trim_whitespace=False), required=False,
                                        max_length=keys.MAX_NAMES, help_text="Model names (served names or aliases).")
    deployments = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=2**63 - 1), required=False,
                                        max_length=100, help_text="Deployment ids.")
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
    rps_limit = serializers.FloatField(required=False, allow_null=True, help_text="Requests per second.")
    tpm_limit = serializers.IntegerField(required=False, allow_null=True, help_text="Tokens (prompt + output) a minute.")
    max_concurrency = serializers.IntegerField(required=False, allow_null=True, help_text="Requests in flight at once.")

    def service_args(self) -> dict:
        v = self.validated_data
        names = {"model_names": "model_names", "deployments": "deployments", "expires_at": "expires_at",
                 "rps_limit": "rps", "tpm_limit": "tpm", "max_concurrency": "concurrency"}
        return {arg: v[field] for field, arg in names.items() if field in v}


class KeyCreateSerializer(KeyScopeSerializer):
    name = serializers.CharField(max_length=100, help_text="What it is for: a team, a script.")


class KeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Callers' keys for the node gateways. Every role reads them (never a secret); operators create and change
    their own, admins everyone's."""

    serializer_class = KeySerializer
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self):
        return selectors.keys_listed()

    @extend_schema(parameters=[OpenApiParameter("mine", bool, description="only the caller's own keys"),
                               OpenApiParameter("name", str)])
    def list(self, request):
        found = self.get_queryset()
        if request.query_params.get("mine") in ("1", "true", "yes"):
            found = found.filter(owner=request.user)
        if request.query_params.get("name"):
            found = found.filter(name=request.query_params["name"])
        page = self.paginate_queryset(found)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(request=KeyCreateSerializer, responses={201: KeyCreatedSerializer})
    @idempotent
    def create(self, request):
        """Create a key; its secret is in this answer and nowhere else, ever."""
        body = KeyCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key, secret = keys.key_create(request.user, body.validated_data["name"], **body.service_args())
        key = self.get_queryset().get(pk=key.pk)
        key.secret = secret
        return Response(KeyCreatedSerializer(key).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=KeyScopeSerializer, responses={200: KeySerializer})
    def partial_update(self, request, pk=None):
        """Change scope, expiry or limits; every gateway applies them within a second."""
        body = KeyScopeSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        keys.key_update(self.get_object(), request.user, **body.service_args())
        return Response(KeySerializer(self.get_queryset().get(pk=pk)).data)

    @extend_schema(request=None, responses={200: KeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        """Revoke the key: every gateway refuses it within a second; its usage stays."""
        keys.key_revoke(self.get_object(), request.user)
        return Response(KeySerializer(self.get_queryset().get(pk=pk)).data)


class CsvRenderer(BaseRenderer):
    media_type = "text/csv"
    format = "csv"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data if isinstance(data, (str, bytes)) else JSONRenderer().render(data)


class UsageView(APIView):
    renderer_classes = [JSONRenderer, CsvRenderer]

    @extend_schema(parameters=[OpenApiParameter("group", str, enum=list(selectors.GROUPS), description="default key"),
                               OpenApiParameter("by", str, enum=list(selectors.BY), description="default hour"),
                               OpenApiParameter("days", int, description="how far back (default: 2 by hour, 30 by day)"),
                               OpenApiParameter("key", int, description="one key's id"),
                               OpenApiParameter("format", str, enum=["json", "csv"])],
                   responses=dict)
    def get(self, request):
        """Callers' usage summed by hour or day, per key, model name or deployment: requests, errors, prompt tokens,
        and output tokens split into reasoning and content."""
        params = request.query_params
        group, by = params.get("group") or "key", params.get("by") or "hour"
        rows = selectors.usage(group, by, params.get("days"), key_id=int_param(params, "key", low=1))
        if request.accepted_renderer.format == "csv":
            answer = HttpResponse(selectors.usage_csv(rows), content_type="text/csv; charset=utf-8")
            answer["Content-Disposition"] = f'attachment; filename="usage-{group}-{by}.csv"'
            return answer
        return Response({"group": group, "by": by, "measures": list(selectors.MEASURES),
                         "rows": [{**r, "period": r["period"].isoformat()} for r in rows]})


router = DefaultRouter(trailing_slash=True)
router.include_root_view = False
router.register("keys", KeyViewSet, basename="api-key")
urlpatterns = router.urls + [path("usage/", UsageView.as_view(), name="api-usage")]
