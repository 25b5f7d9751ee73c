from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from deployments import validators
from deployments.models import Deployment, DeploymentEvent, Gpu, ModelCopy, ModelRepo, Node


def _django(validator):
    """Run a Django validator inside DRF, keeping its message."""
    def run(value):
        try:
            validator(value)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.messages) from exc
    return run


class GpuSerializer(serializers.ModelSerializer):
    class Meta:
        model = Gpu
        fields = ["index", "uuid", "name", "memory_total", "compute_capability"]


class NodeSerializer(serializers.ModelSerializer):
    gpus = GpuSerializer(many=True, read_only=True)
    queue = serializers.CharField(read_only=True)
    online = serializers.BooleanField(read_only=True)

    class Meta:
        model = Node
        fields = ["id", "name", "queue", "address", "agent_version", "online", "last_heartbeat", "heartbeat_seconds",
                  "model_store", "disk_total", "disk_free", "nvml_error", "gpus"]


class ModelCopySerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    percent = serializers.FloatField(read_only=True)
    seconds_left = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = ModelCopy
        fields = ["id", "model", "node", "state", "path", "bytes_done", "bytes_total", "percent", "rate", "seconds_left",
                  "progress", "error", "error_code", "last_used", "updated"]


class ModelAddSerializer(serializers.Serializer):
    """Either a Hub repo (repo_id, revision) or a folder already on a node (node, local_path)."""

    repo_id = serializers.CharField(required=False, max_length=200, validators=[_django(validators.validate_repo_id)])
    revision = serializers.CharField(required=False, default="main", max_length=200,
                                     validators=[_django(validators.validate_revision)])
    node = serializers.SlugRelatedField(slug_field="name", queryset=Node.objects.all(), required=False)
    local_path = serializers.CharField(required=False, max_length=1024, validators=[_django(validators.validate_local_path)])

    def validate(self, data):
        if bool(data.get("repo_id")) == bool(data.get("local_path")):
            raise serializers.ValidationError({"repo_id": ["Give either repo_id or node and local_path."]})
        if data.get("local_path") and not data.get("node"):
            raise serializers.ValidationError({"node": ["A local folder needs the node it is on."]})
        return data


class NodeChoiceSerializer(serializers.Serializer):
    node = serializers.SlugRelatedField(slug_field="name", queryset=Node.objects.all())


class FitQuerySerializer(serializers.Serializer):
    node = serializers.SlugRelatedField(slug_field="name", queryset=Node.objects.all())
    tp = serializers.IntegerField(min_value=1, max_value=64, default=8)
    pp = serializers.IntegerField(min_value=1, max_value=64, default=1)
    gpu_memory_utilization = serializers.FloatField(min_value=0.05, max_value=1.0, default=0.9)
    kv_cache_dtype = serializers.ChoiceField(choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"], default="auto")


class ModelRepoSerializer(serializers.ModelSerializer):
    copies = ModelCopySerializer(many=True, read_only=True)

    class Meta:
        model = ModelRepo
        exclude = ["config", "files"]


class DeploymentEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeploymentEvent
        fields = ["id", "step", "message", "level", "started", "ended", "data"]


class DeploymentSerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    gpus = serializers.SerializerMethodField()

    class Meta:
        model = Deployment
        fields = ["id", "name", "model", "node", "gpus", "port", "engine_args", "env", "status", "status_message",
                  "pid", "log_path", "systemd_unit", "load_phase", "load_percent", "created", "started", "ready_at", "stopped_at"]

    def get_gpus(self, obj) -> list[int]:
        return [gpu.index for gpu in obj.gpus.all()]
