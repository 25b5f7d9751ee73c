from django.contrib import admin

from deployments import secrets
from deployments.models import Deployment, DeploymentEvent, DeploymentRank, Gpu, ModelCopy, ModelRepo, Node


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "address", "agent_version", "last_heartbeat", "disk_free"]
    search_fields = ["name", "address"]
    inlines = [GpuInline]


@admin.register(ModelRepo)
class ModelRepoAdmin(admin.ModelAdmin):
    list_display = ["repo_id", "revision", "architecture", "quant_method", "total_size"]
    search_fields = ["repo_id"]


@admin.register(ModelCopy)
class ModelCopyAdmin(admin.ModelAdmin):
    list_display = ["model", "node", "state", "bytes_done", "bytes_total", "last_used"]
    list_filter = ["state", "node"]


class DeploymentEventInline(admin.TabularInline):
    model = DeploymentEvent
    extra = 0


class DeploymentRankInline(admin.TabularInline):
    """A multi-node deployment's worker ranks; the log tail stays on the panel's page (redacted)."""

    model = DeploymentRank
    extra = 0
    fields = ["rank", "node", "gpu_indices", "state", "message", "pid", "load_phase", "load_percent"]
    readonly_fields = fields


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "model", "node", "port", "status", "created"]
    list_filter = ["status", "node"]
    search_fields = ["name"]
    inlines = [DeploymentRankInline, DeploymentEventInline]
    # Secrets are write-only here too (deployments/secrets.py): shown masked, edited on the panel's form.
    exclude = ["env", "engine_args", "log_tail", "ray_token"]
    # What the agent writes and root acts on (a unit it unlinks, a log it reads into the page): never typed here.
    readonly_fields = ["environment", "engine_flags", "log", "systemd_unit", "log_path", "marker", "pid", "pgid"]

    @admin.display(description="Environment")
    def environment(self, obj):
        return secrets.mask(obj.env, secrets.marked(obj))

    @admin.display(description="Engine flags")
    def engine_flags(self, obj):
        return secrets.mask(obj.engine_args)

    @admin.display(description="Log tail")
    def log(self, obj):
        return secrets.redact_deployment(obj, obj.log_tail)
