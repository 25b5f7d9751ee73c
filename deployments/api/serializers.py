from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from deployments import callit, flagpolicy, launcherstate, secrets, validators
from deployments.userflags import PRESETS
from deployments.gateway import selectors as gateway_selectors
from deployments.models import Deployment, DeploymentEvent, DeploymentRank, Gpu, ModelCopy, ModelRepo, Node, SleepProbe
from plumbing.params import DB_INT_MAX


class NodeField(serializers.SlugRelatedField):
    """A node by name; a value that cannot be a node name is refused before the database sees it."""

    def __init__(self, **kwargs):
        super().__init__(slug_field="name", queryset=Node.objects.all(), **kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str) or not validators.NODE_NAME.match(data):
            self.fail("does_not_exist", slug_name=self.slug_field, value=str(data)[:80])
        return super().to_internal_value(data)


class ModelField(serializers.PrimaryKeyRelatedField):
    """A model by its id, or by its repo id as panelctl and the Hub name it ("org/name", "org/name@revision")."""

    def __init__(self, **kwargs):
        super().__init__(queryset=ModelRepo.objects.all(), **kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str) and not data.strip().isdigit():
            repo, _, revision = data.strip()[:400].partition("@")
            found = ModelRepo.objects.filter(repo_id=repo, revision=revision or "main").first()
            if found is None:
                self.fail("does_not_exist", pk_value=data[:120])
            return found
        return super().to_internal_value(data)


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
    live = serializers.SerializerMethodField(help_text="The last sample: per GPU memory, utilization, temperature, power.")
    agent_restart = serializers.SerializerMethodField(
        help_text="In a node's own answer (not the list), while `./panel start` is to start the node's exited agent "
                  "again: its exit code, when it exited and when it starts again (Unix times); else null.")

    class Meta:
        model = Node
        fields = ["id", "name", "queue", "address", "agent_version", "online", "last_heartbeat", "heartbeat_seconds",
                  "model_store", "disk_total", "disk_free", "nvml_error", "engine_version", "engine_error", "systemd",
                  "gpus", "live", "disk_read", "agent_restart"]

    def get_agent_restart(self, node) -> dict | None:
        # The list's rows are kept until a table they read changes (NodeViewSet.list): a file's news would go stale.
        return None if "latest" in self.context else launcherstate.agent_restart(node)

    def get_live(self, node) -> dict | None:
        if "latest" in self.context:  # read by the caller for the whole list (deployments.selectors.node_live_fields)
            return self.context["latest"].get(node.pk)
        from deployments import history

        return history.latest(node.pk)


class ModelCopySerializer(serializers.ModelSerializer):
    node = serializers.SlugRelatedField(slug_field="name", read_only=True)
    percent = serializers.FloatField(read_only=True)
    seconds_left = serializers.FloatField(read_only=True, allow_null=True)

    class Meta:
        model = ModelCopy
        fields = ["id", "model", "node", "state", "path", "bytes_done", "bytes_total", "percent", "rate", "seconds_left",
                  "progress", "error", "error_code", "last_used", "updated"]

    _stamp = serializers.DateTimeField().to_representation

    def to_representation(self, copy):
        """What DRF's fields give (tests/deployments/test_api_models.py compares the two), written out: the copy
        and model lists render every copy of every model on each download's progress, and DRF's per-field
        machinery cost ~0.1 ms a copy."""
        stamp = self._stamp
        return {"id": copy.pk, "model": copy.model_id, "node": copy.node.name, "state": copy.state, "path": copy.path,
                "bytes_done": copy.bytes_done, "bytes_total": copy.bytes_total, "percent": float(copy.percent),
                "rate": float(copy.rate), "seconds_left": None if copy.seconds_left is None else float(copy.seconds_left),
                "progress": copy.progress, "error": copy.error, "error_code": copy.error_code,
                "last_used": stamp(copy.last_used) if copy.last_used else None,
                "updated": stamp(copy.updated) if copy.updated else None}


class ModelAddSerializer(serializers.Serializer):
    """Either a Hub repo (repo_id, revision) or a folder already on a node (node, local_path)."""

    repo_id = serializers.CharField(required=False, max_length=200, validators=[_django(validators.validate_repo_id)])
    revision = serializers.CharField(required=False, default="main", max_length=200,
                                     validators=[_django(validators.validate_revision)])
    node = NodeField(required=False)
    local_path = serializers.CharField(required=False, max_length=1024, validators=[_django(validators.validate_local_path)])

    def validate(self, data):
        if bool(data.get("repo_id")) == bool(data.get("local_path")):
            raise serializers.ValidationError({"repo_id": ["Give either repo_id or node and local_path."]})
        if data.get("local_path") and not data.get("node"):
            raise serializers.ValidationError({"node": ["A local folder needs the node it is on."]})
        return data


class NodeChoiceSerializer(serializers.Serializer):
    node = NodeField()


class FitQuerySerializer(serializers.Serializer):
    node = NodeField()
    tp = serializers.IntegerField(min_value=1, max_value=64, required=False,
                                  help_text="Default: the node's GPU count (its largest power of two; 1 on a CPU node).")
    pp = serializers.IntegerField(min_value=1, max_value=64, default=1)
    gpu_memory_utilization = serializers.FloatField(min_value=0.05, max_value=1.0,
                                                    default=flagpolicy.GPU_MEMORY_UTILIZATION)
    kv_cache_dtype = serializers.ChoiceField(choices=flagpolicy.KV_CACHE_DTYPES, default=flagpolicy.KV_CACHE_DTYPE)


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
                  "pid", "log_path", "systemd_unit", "load_phase", "load_percent", "created", "started", "ready_at", "stopped_at",
                  "sleep_mode", "start_asleep", "sleep_level", "sleep_ram_bytes"]

    def get_gpus(self, obj) -> list[int]:
        return [gpu.index for gpu in obj.gpus.all()]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        for field in ("engine_args", "env"):  # secrets are write-only (deployments/secrets.py)
            if field in data:
                data[field] = secrets.mask(data[field], secrets.marked(instance))
        return data


class RankSerializer(serializers.ModelSerializer):
    """A worker node's rank of a multi-node deployment."""

    node = serializers.SlugRelatedField(slug_field="name", read_only=True)

    class Meta:
        model = DeploymentRank
        fields = ["rank", "node", "gpu_indices", "state", "message", "pid", "load_phase", "load_percent"]


class DeploymentDetailSerializer(DeploymentSerializer):
    ranks = RankSerializer(many=True, read_only=True)
    call = serializers.SerializerMethodField(help_text="How to call it: base_url, models (the names to put in "
                                             "\"model\"), key_required, and curl and OpenAI-Python snippets.")
    route = serializers.SerializerMethodField(help_text="At the gateway: aliases, max_in_flight, queue_bound, media_domains.")
    sleep_probe = serializers.SerializerMethodField(help_text="The last sleep probe of its model commit, engine, memory "
                                                    "flags and GPUs: verdict, per-level figures, reason (null: none).")

    class Meta(DeploymentSerializer.Meta):
        fields = DeploymentSerializer.Meta.fields + ["master_port", "ranks", "smoke", "load_detail", "auto_restart", "retry_advised", "restarts", "stall_seconds",
                                                     "secret_env", "replace", "base_url", "stop_foreign", "prewarm",
                                                     "reuse_memory_profile", "expires_at", "expired",
                                                     "call", "route", "sleep_probe"]

    def get_sleep_probe(self, obj) -> dict | None:
        if not obj.sleep_mode:
            return None
        probe = SleepProbe.last_for(obj)
        return probe and {"id": probe.pk, "verdict": probe.verdict, "created": probe.created, "ended": probe.ended,
                          "levels": probe.levels, "reason": probe.reason}

    def get_call(self, obj) -> dict:
        return callit.call(obj)

    def get_route(self, obj) -> dict:
        return gateway_selectors.route_of(obj.pk)


class WorkerSerializer(serializers.Serializer):
    """One more node of a multi-node placement and its GPUs (none on a CPU node)."""

    node = NodeField()
    gpus = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=1023), required=False, default=list,
                                 max_length=64)


class DeployRequestSerializer(serializers.Serializer):
    """A deploy: engine flags as a dict ({"tensor-parallel-size": 8}), environment as a dict; `workers`
    spread it over more nodes (`node` is the head, rank 0)."""

    model = ModelField(help_text='The model\'s id, or its repo id ("org/name", "org/name@revision").')
    node = NodeField()
    name = serializers.SlugField(max_length=80, required=False, default="")
    gpus = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=1023), required=False, default=list,
                                 max_length=64)
    port = serializers.IntegerField(min_value=1024, max_value=65535, required=False, default=None, allow_null=True,
                                    help_text="Default: the first port free on the node (never the panel's own).")
    preset = serializers.ChoiceField(choices=["auto", "none", *PRESETS], default="auto",
                                     help_text="Flags and environment put under engine_args/env (yours win); auto: "
                                               "one GPU on a GPU node, the CPU engine's on a node without GPUs.")
    replace_existing = serializers.BooleanField(default=False, help_text="A deployment with this name exists: "
                                                "redeploy it with these settings instead of answering 409.")
    engine_args = serializers.DictField(required=False, default=dict)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True, max_length=4096), required=False, default=dict)
    secret_env = serializers.ListField(child=serializers.CharField(max_length=200), required=False, default=list, max_length=100,
                                       help_text="Names in env to keep secret (masked everywhere, like *_TOKEN).")
    replace = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=DB_INT_MAX), required=False, default=list, max_length=64)
    auto_restart = serializers.BooleanField(default=False)
    retry_advised = serializers.BooleanField(default=True, help_text="When the start fails for a memory cause whose fix "
                                             "is certain (the KV cache too small, out of memory), start once more with "
                                             "the advised setting (docs/deploying.md, When a start fails).")
    stall_seconds = serializers.IntegerField(min_value=30, max_value=86400, default=600)
    stop_foreign = serializers.BooleanField(default=False, help_text="Stop processes the panel did not start on the "
                                            "chosen GPUs (never display servers); without it such a deploy answers 409.")
    prewarm = serializers.BooleanField(default=False, help_text="Read the model's shards into the page cache while other "
                                       "engines stop, before launch, when free RAM allows.")
    reuse_memory_profile = serializers.BooleanField(default=False, help_text="Start with the KV cache size the last "
                                                    "load of this model, GPUs, settings and engine chose "
                                                    "(--kv-cache-memory-bytes): no profiling run. Refused ("
                                                    "no_memory_profile) when none matches.")
    sleep_mode = serializers.BooleanField(default=False, help_text="Start with vLLM's sleep mode (CUDA GPUs, one node): it "
                                          "can sleep and wake, and share its GPUs with other sleep-mode deployments, one "
                                          "awake at a time (swap). Admins only (403 otherwise): it starts the engine with "
                                          "VLLM_SERVER_DEV_MODE=1, whose development routes answer local processes without a key.")
    start_asleep = serializers.BooleanField(default=False, help_text="Once loaded and smoke-tested, put it to sleep (and "
                                            "wake again those its plan put to sleep): ready to be swapped to.")
    override_fit = serializers.BooleanField(default=False, help_text="Deploy although the fit check says the model does "
                                            "not fit (admins only; recorded on the timeline); without it such a deploy "
                                            "answers 409 does_not_fit.")
    recipe = serializers.CharField(required=False, default="", allow_blank=True, max_length=300,
                                   help_text="Start from this recipe (its id or model id, see /api/recipes/): its flags "
                                             "and environment for the node go under engine_args/env (yours win), "
                                             "its GPUs by default; the timeline says what you changed.")
    variant = serializers.CharField(required=False, default="", allow_blank=True, max_length=80,
                                    help_text="The recipe's variant (default: default).")
    strategy = serializers.CharField(required=False, default="", allow_blank=True, max_length=80,
                                     help_text="The recipe's strategy, e.g. single_node_tp (default: its first that "
                                               "applies to the node).")
    override_compat = serializers.BooleanField(default=False, help_text="Deploy although the compatibility check says "
                                               "it would fail (admins only; recorded on the timeline); without it "
                                               "such a deploy answers 409 incompatible.")
    workers = WorkerSerializer(many=True, required=False, default=list, max_length=63,
                               help_text="Multi-node: more nodes, each with its GPUs. With data-parallel-size 1, TP × PP is "
                                         "split evenly over all; above 1, each node runs its GPUs / (TP × PP) replicas "
                                         "(CPU nodes: data-parallel-size / nodes) with vLLM's data-parallel launch.")
    master_port = serializers.IntegerField(min_value=1024, max_value=65535, required=False, default=None, allow_null=True,
                                           help_text="Multi-node: the head's port the ranks meet at, its DP RPC port "
                                                     "with data-parallel-size > 1 (default: from 29500).")
    aliases = serializers.ListField(child=serializers.CharField(max_length=200), required=False, default=list, max_length=50,
                                    help_text="More model names callers may use at the gateway (e.g. kimi): a name follows a swap.")
    max_in_flight = serializers.IntegerField(required=False, default=None, allow_null=True,
                                             help_text="Requests the gateway sends to it at once (default: its --max-num-seqs).")
    queue_bound = serializers.IntegerField(required=False, default=None, allow_null=True,
                                           help_text="Requests waiting in the gateway beyond that (default 256); then 429.")
    media_domains = serializers.ListField(child=serializers.CharField(max_length=253), required=False, default=list,
                                          max_length=100, help_text="Domains multimodal URLs may come from (empty: data: URLs only).")

    def validate_engine_args(self, value):
        from deployments import userflags

        if len(value) > 100:
            raise serializers.ValidationError("At most 100 engine flags.")
        for name, v in value.items():
            if not isinstance(v, (str, int, float, bool)) or v is None:
                raise serializers.ValidationError(f"--{str(name)[:40]}: a value is a string, number or true/false.")
        try:  # one canonical spelling (flagpolicy): tensor_parallel_size and --TENSOR-PARALLEL-SIZE are one flag
            value = flagpolicy.canonical_flags(value)
        except flagpolicy.OptionError as exc:
            raise serializers.ValidationError(str(exc)) from exc
        name = self.initial_data.get("node") if isinstance(self.initial_data, dict) else None
        node = Node.objects.filter(name=name).first() if isinstance(name, str) and validators.NODE_NAME.match(name) else None
        errors = userflags.check_flags(value, set(node.engine_flags) if node and node.engine_flags else None,
                                       node.engine_modules if node else None)
        if errors:
            raise serializers.ValidationError(errors["extra_flags"])
        return value

    def validate_env(self, value):
        from deployments import userflags

        try:
            value = flagpolicy.canonical_env(value)
        except flagpolicy.OptionError as exc:
            raise serializers.ValidationError(str(exc)) from exc
        errors = userflags.check_env(value)
        if errors:
            raise serializers.ValidationError(errors["env"])
        return value

    def validate(self, attrs):
        env = attrs.get("env", getattr(self.instance, "env", None) or {})
        if problem := secrets.check_marked(attrs.get("secret_env", ()), env):
            raise serializers.ValidationError({"secret_env": [problem]})
        return attrs


class RedeploySerializer(serializers.Serializer):
    gpus = serializers.ListField(child=serializers.IntegerField(min_value=0, max_value=1023), required=False, max_length=64)
    port = serializers.IntegerField(min_value=1024, max_value=65535, required=False)
    engine_args = serializers.DictField(required=False)
    env = serializers.DictField(child=serializers.CharField(allow_blank=True, max_length=4096), required=False)
    secret_env = serializers.ListField(child=serializers.CharField(max_length=200), required=False, max_length=100)
    auto_restart = serializers.BooleanField(required=False)
    retry_advised = serializers.BooleanField(required=False, help_text="A restart retries a failed start only when asked.")
    stall_seconds = serializers.IntegerField(min_value=30, max_value=86400, required=False)
    stop_foreign = serializers.BooleanField(required=False)
    prewarm = serializers.BooleanField(required=False)
    reuse_memory_profile = serializers.BooleanField(required=False)
    sleep_mode = serializers.BooleanField(required=False)
    start_asleep = serializers.BooleanField(required=False)
    override_fit = serializers.BooleanField(required=False, help_text="As for a deploy: admins only.")
    override_compat = serializers.BooleanField(required=False, help_text="As for a deploy: admins only.")
    workers = WorkerSerializer(many=True, required=False, max_length=63,
                               help_text="Multi-node: the worker nodes and their GPUs from now on (default: as placed).")

    validate_engine_args = DeployRequestSerializer.validate_engine_args
    validate_env = DeployRequestSerializer.validate_env


class SleepSerializer(serializers.Serializer):
    level = serializers.ChoiceField(choices=[1, 2], required=False, allow_null=True, help_text="1: weights to host RAM; "
                                    "2: weights dropped (read again at wake); none: chosen by the host's free RAM.")


class RollbackSerializer(serializers.Serializer):
    version = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                       help_text="The version to deploy again (none: the known good one).")


class SwapSerializer(serializers.Serializer):
    to = serializers.PrimaryKeyRelatedField(queryset=Deployment.objects.all(), help_text="The deployment to swap to "
                                            "(asleep on the same GPUs, or stopped: deployed again).")
