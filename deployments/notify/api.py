"""/api/notify/: the signed-in user's channels (add, remove, test), subscriptions, quiet hours, and the delivery
log. Any role may use it for themselves (webhook channels: admins); the services say who may do what."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments.notify import catalog, services
from deployments.notify.models import Delivery, QuietHours, Slo
from plumbing import roles


class ChannelSerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    kind = serializers.ChoiceField(choices=services.Channel.Kind.choices)
    name = serializers.CharField(max_length=80)
    target = serializers.CharField(max_length=600, write_only=True, help_text="E-mail address or webhook URL.")
    shown = serializers.CharField(read_only=True, help_text="The address, or the webhook's scheme and host only.")
    failing = serializers.BooleanField(read_only=True)
    last_error = serializers.CharField(read_only=True)


class SubscriptionSerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    kinds = serializers.ListField(child=serializers.ChoiceField(choices=catalog.SUBSCRIBABLE), required=False, default=list)
    deployment = serializers.IntegerField(source="deployment_id", required=False, allow_null=True, min_value=1, max_value=2**62)
    node = serializers.IntegerField(source="node_id", required=False, allow_null=True, min_value=1, max_value=2**62)
    team = serializers.IntegerField(source="team_id", required=False, allow_null=True, min_value=1, max_value=2**62,
                                    help_text="A group you are in: every member hears of it on their own channels.")


class SloSerializer(serializers.Serializer):
    deployment = serializers.IntegerField(source="deployment_id", read_only=True)
    ttft_p95_ms = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=1, max_value=3_600_000,
                                           help_text="TTFT p95 at most this over the last 5 minutes (ms).")
    error_pct = serializers.FloatField(required=False, allow_null=True, default=None, min_value=0, max_value=99.999,
                                       help_text="At most this share of requests aborted or failed (%).")
    refused_pct = serializers.FloatField(required=False, allow_null=True, default=None, min_value=0, max_value=99.999,
                                         help_text="At most this share of requests the engine refused for load (its "
                                         "admission caps) (%).")
    minutes = serializers.IntegerField(required=False, default=5, min_value=0, max_value=services.SLO_MAX_MINUTES,
                                       help_text="How long a breach lasts before it is told (0: at once).")
    breach_since = serializers.DateTimeField(read_only=True, allow_null=True)


class QuietSerializer(serializers.Serializer):
    start = serializers.TimeField(allow_null=True)
    end = serializers.TimeField(allow_null=True)
    tz = serializers.CharField(max_length=64, default="UTC")


class DeliverySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    channel = serializers.IntegerField(source="channel_id")
    phase = serializers.CharField()
    status = serializers.CharField()
    event = serializers.CharField(source="alert.kind", default="test")
    title = serializers.CharField(source="alert.title", default="Test message")
    attempts = serializers.IntegerField()
    status_code = serializers.IntegerField(allow_null=True)
    error = serializers.CharField()
    created = serializers.DateTimeField()
    sent = serializers.DateTimeField(allow_null=True)
    log = serializers.SerializerMethodField()

    def get_log(self, d) -> list[dict]:
        return [{"at": a.at.isoformat(), "status_code": a.status_code, "ok": a.ok, "error": a.error} for a in d.log.all()]


def _call(fn, *args):
    try:
        return fn(*args)
    except services.NotifyError as exc:
        if exc.forbidden:
            raise PermissionDenied(str(exc)) from None
        if exc.missing:
            raise NotFound(str(exc)) from None
        raise ValidationError({"detail": str(exc)}) from None


class _Mine(APIView):
    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        if not roles.is_viewer(request.user):
            raise PermissionDenied("Notifications need a role (viewer, operator or admin).")


class ChannelList(_Mine):
    @extend_schema(responses=ChannelSerializer(many=True))
    def get(self, request):
        return Response(ChannelSerializer(request.user.notify_channels.all(), many=True).data)

    @extend_schema(request=ChannelSerializer, responses=ChannelSerializer)
    def post(self, request):
        s = ChannelSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        channel, key = _call(services.channel_add, request.user, s.validated_data["kind"], s.validated_data["name"],
                             s.validated_data["target"])
        body = ChannelSerializer(channel).data
        if key:
            body["signing_key"] = key  # shown this once
        return Response(body, status=status.HTTP_201_CREATED)


class ChannelDetail(_Mine):
    def delete(self, request, pk: int):
        _call(services.channel_remove, request.user, pk)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ChannelTest(_Mine):
    @extend_schema(request=None, responses=DeliverySerializer)
    def post(self, request, pk: int):
        delivery = _call(services.channel_test, request.user, pk)
        return Response(DeliverySerializer(delivery).data, status=status.HTTP_202_ACCEPTED)


class SubscriptionList(_Mine):
    @extend_schema(responses=SubscriptionSerializer(many=True))
    def get(self, request):
        return Response(SubscriptionSerializer(request.user.notify_subscriptions.all(), many=True).data)

    @extend_schema(request=SubscriptionSerializer, responses=SubscriptionSerializer)
    def post(self, request):
        s = SubscriptionSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        sub = _call(services.subscription_add, request.user, v.get("kinds", []), v.get("deployment_id"), v.get("node_id"),
                    v.get("team_id"))
        return Response(SubscriptionSerializer(sub).data, status=status.HTTP_201_CREATED)


class SubscriptionDetail(_Mine):
    def delete(self, request, pk: int):
        _call(services.subscription_remove, request.user, pk)
        return Response(status=status.HTTP_204_NO_CONTENT)


class SloList(_Mine):
    """Every deployment's objectives (anyone with a role reads them; operators set them)."""

    @extend_schema(responses=SloSerializer(many=True))
    def get(self, request):
        return Response(SloSerializer(Slo.objects.order_by("deployment_id"), many=True).data)


class SloDetail(_Mine):
    """One deployment's objectives (its id in the path): set (PUT) or dropped (DELETE) by an operator."""

    @extend_schema(request=SloSerializer, responses=SloSerializer)
    def put(self, request, pk: int):
        s = SloSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        slo = _call(services.slo_set, request.user, pk, v["ttft_p95_ms"], v["error_pct"], v["minutes"], v["refused_pct"])
        return Response(SloSerializer(slo).data)

    def delete(self, request, pk: int):
        _call(services.slo_remove, request.user, pk)
        return Response(status=status.HTTP_204_NO_CONTENT)


class Quiet(_Mine):
    @extend_schema(responses=QuietSerializer)
    def get(self, request):
        quiet = QuietHours.objects.filter(user=request.user).first()
        return Response(QuietSerializer(quiet).data if quiet else {"start": None, "end": None, "tz": "UTC"})

    @extend_schema(request=QuietSerializer, responses=QuietSerializer)
    def put(self, request):
        s = QuietSerializer(data=request.data)
        s.is_valid(raise_exception=True)
        v = s.validated_data
        _call(services.quiet_hours_set, request.user, v["start"], v["end"], v["tz"])
        return self.get(request)


class DeliveryList(_Mine):
    @extend_schema(responses=DeliverySerializer(many=True))
    def get(self, request):
        rows = (Delivery.objects.filter(channel__user=request.user).select_related("alert")
                .prefetch_related("log").order_by("-created")[:100])
        return Response(DeliverySerializer(rows, many=True).data)
