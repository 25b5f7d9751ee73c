from rest_framework import serializers

from deployments.models import Deployment, DeploymentEvent, Gpu, ModelCopy, ModelRepo, Node


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

    class Meta:
        model = ModelCopy
        fields = ["id", "model", "node", "state", "path", "bytes_done", "bytes_total", "rate", "error", "last_used"]


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
