"""What sits on a host: nodes, their GPUs, models, model copies and deployments."""
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from controlpanel.states import Transitions


class Node(models.Model):
    """A GPU host running a node agent that consumes the Celery queue `node.<name>`."""

    name = models.SlugField(max_length=64, unique=True)
    address = models.CharField(max_length=255, blank=True, help_text="Host name or IP the engines listen on.")
    agent_version = models.CharField(max_length=64, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    heartbeat_seconds = models.FloatField(default=5.0)
    model_store = models.CharField(max_length=1024, blank=True)
    disk_total = models.BigIntegerField(default=0)
    disk_free = models.BigIntegerField(default=0)
    ram_total = models.BigIntegerField(default=0, help_text="Host RAM in bytes (what a CPU engine holds weights in).")
    cpu_count = models.PositiveIntegerField(default=0, help_text="Logical CPUs of the host.")
    nvml_error = models.CharField(max_length=255, blank=True, help_text="Why NVML is unavailable, if it is.")
    engine_version = models.CharField(max_length=64, blank=True)
    engine_flags = models.JSONField(default=list, blank=True, help_text="Flags the node's `vllm serve` accepts.")
    engine_error = models.CharField(max_length=500, blank=True, help_text="Why the engine could not be inspected.")
    systemd = models.BooleanField(default=False, help_text="The agent can install systemd units here.")
    engine_user = models.JSONField(default=dict, blank=True,
                                   help_text="Who the agent runs engines as (host/engineuser.EngineUser.facts()).")
    agent_host = models.CharField(max_length=255, blank=True, help_text="Host name of the agent that heartbeats.")
    agent_pid = models.IntegerField(null=True, blank=True, help_text="PID of the agent that heartbeats.")
    foreign_processes = models.JSONField(default=list, blank=True,
                                         help_text="Processes on the GPUs the panel did not start, as the agent last saw them.")
    disk_read = models.JSONField(default=dict, blank=True,
                                 help_text="The model store's sequential read rate: {bps, bytes, cold, at} (issue 16).")
    gateway_port = models.PositiveIntegerField(null=True, blank=True,
                                               help_text="The port the node's gateway listens on, as its gateway reports it.")
    host_checks = models.JSONField(default=dict, blank=True,
                                   help_text="The host doctor's last report: {at, checks: [{name, status, summary, fix, data}], "
                                             "topology, nccl_presets} (deployments/host/doctor.py, issue 29).")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    @property
    def queue(self) -> str:
        return f"node.{self.name}"

    @property
    def online(self) -> bool:
        """Online while the last heartbeat is younger than three heartbeat intervals."""
        if self.last_heartbeat is None:
            return False
        return timezone.now() - self.last_heartbeat < timedelta(seconds=3 * self.heartbeat_seconds)

    @property
    def has_gpu(self) -> bool:
        return not self.nvml_error


class Gpu(models.Model):
    """One NVIDIA GPU of a node, as NVML reports it."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=96, blank=True)
    name = models.CharField(max_length=128, blank=True)
    memory_total = models.BigIntegerField(default=0)
    compute_capability = models.CharField(max_length=16, blank=True)

    class Meta:
        ordering = ["node", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node")]

    def __str__(self):
        return f"{self.node.name}:{self.index} {self.name}"


class ModelRepo(models.Model):
    """A Hugging Face model repository (or a local folder) and what its config says."""

    class Attention(models.TextChoices):
        MLA = "mla", "MLA"
        GQA = "gqa", "GQA"
        MHA = "mha", "MHA"
        MQA = "mqa", "MQA"
        UNKNOWN = "", "unknown"

    repo_id = models.CharField(max_length=200)
    revision = models.CharField(max_length=200, default="main")
    commit = models.CharField(max_length=64, blank=True)
    local_path = models.CharField(max_length=1024, blank=True, help_text="A folder already on a node, instead of the hub.")
    files = models.JSONField(default=list, blank=True, help_text="[{path, size, sha256}]")
    total_size = models.BigIntegerField(default=0)
    config = models.JSONField(default=dict, blank=True)
    inspect_error = models.TextField(blank=True)
    inspected = models.DateTimeField(null=True, blank=True)
    # Parsed from config.json.
    architecture = models.CharField(max_length=128, blank=True)
    model_type = models.CharField(max_length=64, blank=True)
    num_parameters = models.BigIntegerField(null=True, blank=True)
    active_parameters = models.BigIntegerField(null=True, blank=True, help_text="Per token, for MoE.")
    num_layers = models.PositiveIntegerField(null=True, blank=True)
    hidden_size = models.PositiveIntegerField(null=True, blank=True)
    num_attention_heads = models.PositiveIntegerField(null=True, blank=True)
    num_kv_heads = models.PositiveIntegerField(null=True, blank=True)
    head_dim = models.PositiveIntegerField(null=True, blank=True)
    attention = models.CharField(max_length=8, choices=Attention.choices, blank=True)
    kv_lora_rank = models.PositiveIntegerField(null=True, blank=True)
    qk_rope_head_dim = models.PositiveIntegerField(null=True, blank=True)
    num_experts = models.PositiveIntegerField(null=True, blank=True)
    num_shared_experts = models.PositiveIntegerField(null=True, blank=True)
    experts_per_token = models.PositiveIntegerField(null=True, blank=True)
    quant_method = models.CharField(max_length=64, blank=True)
    quant_bits = models.PositiveSmallIntegerField(null=True, blank=True)
    quant_group_size = models.IntegerField(null=True, blank=True)
    quant_details = models.JSONField(default=dict, blank=True, help_text="Unquantized modules, KV-cache scheme, ...")
    dtype = models.CharField(max_length=32, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["repo_id", "revision"]
        constraints = [models.UniqueConstraint(fields=["repo_id", "revision"], name="model_unique_repo_revision")]

    def __str__(self):
        return self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"


class ModelCopy(Transitions, models.Model):
    """A model's files on one node: downloading, complete, failed or being deleted."""

    class State(models.TextChoices):
        QUEUED = "queued", "Queued"
        DOWNLOADING = "downloading", "Downloading"  # the sha256 of each file is checked as it arrives
        READY = "ready", "Ready"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"
        DELETING = "deleting", "Deleting"

    ACTIVE = frozenset({State.QUEUED, State.DOWNLOADING, State.DELETING})
    DOWNLOADABLE = frozenset({State.QUEUED, State.DOWNLOADING})  # a download task has work to do
    STATUS_FIELD = "state"
    # QUEUED -> QUEUED: a deploy asks again; DOWNLOADING -> DOWNLOADING: a redelivered or resumed task.
    TRANSITIONS = {
        State.QUEUED: {State.QUEUED, State.DOWNLOADING, State.CANCELLED, State.DELETING},
        State.DOWNLOADING: {State.DOWNLOADING, State.READY, State.FAILED, State.CANCELLED},
        State.READY: {State.DELETING},
        State.FAILED: {State.QUEUED, State.DELETING},
        State.CANCELLED: {State.QUEUED, State.DELETING},
        State.DELETING: {State.DELETING, State.READY},  # READY: removal refused, an engine uses the folder
    }

    model = models.ForeignKey(ModelRepo, on_delete=models.CASCADE, related_name="copies")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="model_copies")
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    path = models.CharField(max_length=1024, blank=True)
    bytes_done = models.BigIntegerField(default=0)
    bytes_total = models.BigIntegerField(default=0)
    rate = models.FloatField(default=0.0, help_text="Bytes per second, recent.")
    progress = models.JSONField(default=dict, blank=True, help_text="Per-file progress.")
    error = models.TextField(blank=True)
    error_code = models.CharField(max_length=32, blank=True)
    cancel_requested = models.BooleanField(default=False)
    last_used = models.DateTimeField(null=True, blank=True)
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node", "model"]
        constraints = [models.UniqueConstraint(fields=["model", "node"], name="copy_unique_per_node")]

    def __str__(self):
        return f"{self.model} on {self.node}"

    @property
    def percent(self) -> float:
        return 100.0 * self.bytes_done / self.bytes_total if self.bytes_total else 0.0

    @property
    def seconds_left(self):
        if self.rate <= 0 or not self.bytes_total:
            return None
        return max(self.bytes_total - self.bytes_done, 0) / self.rate


class Secret(models.Model):
    """A credential the panel uses (the Hugging Face token); written in the UI, never shown back, stored
    encrypted (deployments/sealed.py)."""

    HF_TOKEN = "hf_token"

    name = models.CharField(max_length=64, unique=True)
    value = models.TextField()
    updated = models.DateTimeField(auto_now=True)

    def __str__(self):
        return self.name  # never the value

    def __repr__(self):
        return f"<Secret {self.name}>"

    @classmethod
    def get(cls, name: str, default: str = "") -> str:
        """The stored value, decrypted (sealed.Unreadable without this host's key file)."""
        from deployments import sealed

        row = cls.objects.filter(name=name).first()
        return sealed.unseal(row.value) if row else default

    @classmethod
    def put(cls, name: str, value: str) -> None:
        from deployments import sealed

        cls.objects.update_or_create(name=name, defaults={"value": sealed.seal(value)})


class EngineProcess(models.Model):
    """An engine process the panel launched on a node and proves its own: a deployment's head (single-node
    or rank 0) or a worker rank. deployments/node/lifecycle.py launches, follows, halts and adopts either."""

    pid = models.IntegerField(null=True, blank=True)
    pgid = models.IntegerField(null=True, blank=True)
    pid_create_time = models.FloatField(null=True, blank=True, help_text="Guards against PID reuse.")
    marker = models.CharField(max_length=64, blank=True, help_text="PANEL_ENGINE value of the running engine: proves it is ours.")
    log_path = models.CharField(max_length=1024, blank=True)
    shm_files = models.JSONField(default=list, blank=True, help_text="/dev/shm files the engine held, removed once it is gone.")
    load_phase = models.CharField(max_length=64, blank=True)
    load_percent = models.FloatField(null=True, blank=True)
    log_tail = models.TextField(blank=True, help_text="The engine log's last lines, kept after it ends.")

    class Meta:
        abstract = True

    def forget_process(self) -> None:
        """The engine is gone: nothing names a process any more (its log path and tail stay, for the page)."""
        self.pid = self.pgid = self.pid_create_time = None
        self.marker, self.shm_files = "", []


class Deployment(Transitions, EngineProcess):
    """A vLLM engine serving one model on some GPUs of one node."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        PREPARING = "preparing", "Preparing"
        STOPPING_OTHERS = "stopping_others", "Stopping others"
        STARTING = "starting", "Starting"
        LOADING = "loading", "Loading"
        READY = "ready", "Ready"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    ACTIVE = frozenset(
        {Status.QUEUED, Status.PREPARING, Status.STOPPING_OTHERS, Status.STARTING, Status.LOADING, Status.READY, Status.STOPPING}
    )
    TERMINAL = frozenset({Status.STOPPED, Status.FAILED})
    # On its way somewhere: its GPUs cannot be taken, nor the deployment redeployed, until it arrives.
    IN_FLIGHT = ACTIVE - {Status.READY}
    # Where each status may go next. Any active status may fail or be stopped.
    TRANSITIONS = {
        Status.QUEUED: {Status.PREPARING, Status.STOPPING, Status.FAILED},
        Status.PREPARING: {Status.STOPPING_OTHERS, Status.STARTING, Status.STOPPING, Status.FAILED},
        Status.STOPPING_OTHERS: {Status.STARTING, Status.STOPPING, Status.FAILED},
        Status.STARTING: {Status.LOADING, Status.STOPPING, Status.FAILED},
        Status.LOADING: {Status.READY, Status.STOPPING, Status.FAILED},
        Status.READY: {Status.STOPPING, Status.FAILED, Status.LOADING, Status.QUEUED},
        Status.STOPPING: {Status.STOPPED, Status.FAILED},
        Status.STOPPED: {Status.QUEUED},
        Status.FAILED: {Status.QUEUED, Status.STOPPING},
    }

    name = models.SlugField(max_length=80, unique=True)
    model = models.ForeignKey(ModelRepo, on_delete=models.PROTECT, related_name="deployments")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="deployments")
    gpus = models.ManyToManyField(Gpu, related_name="deployments", blank=True)
    port = models.PositiveIntegerField()
    engine_args = models.JSONField(default=dict, blank=True, help_text="vLLM flags, e.g. {'tensor-parallel-size': 8}.")
    env = models.JSONField(default=dict, blank=True, help_text="Extra environment (NCCL_*, VLLM_*, CUDA_*).")
    secret_env = models.JSONField(default=list, blank=True,
                                  help_text="Names in env the user marked secret: masked like secret-looking names.")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    status_message = models.TextField(blank=True)
    systemd_unit = models.CharField(max_length=128, blank=True)
    ray_token = models.CharField(max_length=256, blank=True, help_text="The Ray cluster's token (RAY_AUTH_TOKEN), new at each "
                                 "Ray head start; sealed at rest (deployments/sealed.py); write-only: never shown.")
    engine_key = models.CharField(max_length=256, blank=True, help_text="The engine's own --api-key (issue 28): random per "
                                  "deployment, known to the panel and its gateways only; sealed at rest; never shown.")
    stop_foreign = models.BooleanField(default=False, help_text="Stop other (non-panel) processes on the chosen GPUs.")
    prewarm = models.BooleanField(default=False, help_text="Read the model's shards into the page cache while others stop (issue 16).")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="A queued plan not started by then is dropped.")
    auto_restart = models.BooleanField(default=False)
    restarts = models.PositiveIntegerField(default=0)
    replace = models.JSONField(default=list, blank=True, help_text="Deployments the plan stops first (ids).")
    stall_seconds = models.PositiveIntegerField(default=600, help_text="Fail a load when neither log nor GPU memory moved for this long.")
    master_port = models.PositiveIntegerField(null=True, blank=True,
                                              help_text="Multi-node (issue 17): the head's --master-port the worker ranks join.")
    load_detail = models.JSONField(default=dict, blank=True, help_text="Shards, seconds left, ...")
    smoke = models.JSONField(default=dict, blank=True, help_text="The smoke test's reply, reasoning, latency, tokens.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created = models.DateTimeField(auto_now_add=True)
    started = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created"]

    def __str__(self):
        return self.name

    def transition(self, to, message: str = "", **fields) -> None:
        """Move to `to` with `message` as the status message (cleared when none), or raise InvalidTransition."""
        super().transition(to, status_message=message, **fields)

    def entered(self, status) -> None:
        now = timezone.now()
        if status == self.Status.STARTING:
            self.started = now
        elif status == self.Status.READY:
            self.ready_at = now
        elif status in self.TERMINAL:
            self.stopped_at = now

    @property
    def expired(self) -> bool:
        """Queued, and the node did not start the plan in time (it was offline): nothing was done."""
        return self.status == self.Status.QUEUED and self.expires_at is not None and self.expires_at < timezone.now()

    @property
    def base_url(self) -> str:
        """Where callers reach it: its node's gateway (the engine itself listens on loopback only)."""
        host = self.node.address or "127.0.0.1"
        return f"http://{host}:{self.node.gateway_port or settings.GATEWAY_PORT}"

    @property
    def served_model_name(self) -> str:
        """The name clients use in requests: --served-model-name, else the model path vLLM was given."""
        return str(self.engine_args.get("served-model-name") or "")

    @property
    def gpu_indices(self) -> list[int]:
        return sorted(g.index for g in self.gpus.all())


class DeploymentRank(Transitions, EngineProcess):
    """One worker node's part of a multi-node deployment: its rank, its GPUs and the headless engine (or Ray
    node) that node's agent launches and owns. The head (rank 0) is the Deployment row itself."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        PREPARING = "preparing", "Preparing"  # model copy, stopping holders on its node
        PREPARED = "prepared", "Prepared"
        PREFLIGHT = "preflight", "Pre-flight"  # the head listens on its master port: connect and report
        REACHED = "reached", "Reached the head"
        LAUNCH = "launch", "Launch"  # the head says go
        LOADING = "loading", "Loading"
        RUNNING = "running", "Running"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    ENDED = frozenset({State.STOPPED, State.FAILED})
    ENGINE = frozenset({State.LOADING, State.RUNNING})  # its engine should be running
    STATUS_FIELD = "state"
    # The plan's steps in order (the head moves PREPARED -> PREFLIGHT and REACHED -> LAUNCH, the worker node the
    # rest); any rank not ended may be stopped or fail (added below), and a new plan (a redeploy, an auto-restart)
    # takes any rank back to PENDING.
    TRANSITIONS = {
        State.PENDING: {State.PENDING, State.PREPARING},
        State.PREPARING: {State.PENDING, State.PREPARED},
        State.PREPARED: {State.PENDING, State.PREFLIGHT},
        State.PREFLIGHT: {State.PENDING, State.REACHED},
        State.REACHED: {State.PENDING, State.LAUNCH},
        State.LAUNCH: {State.PENDING, State.LOADING},
        State.LOADING: {State.PENDING, State.RUNNING},
        State.RUNNING: {State.PENDING, State.LOADING},  # loading again: its unit restarts a persisted rank's engine
        State.STOPPING: {State.PENDING},
        State.STOPPED: {State.PENDING},
        State.FAILED: {State.PENDING},
    }
    for _on in (State.PENDING, State.PREPARING, State.PREPARED, State.PREFLIGHT, State.REACHED, State.LAUNCH,
                State.LOADING, State.RUNNING, State.STOPPING):
        TRANSITIONS[_on] = TRANSITIONS[_on] | {State.STOPPING, State.STOPPED, State.FAILED}
    del _on

    @classmethod
    def sources(cls, to) -> set:
        """The states a rank may move to `to` from (for a move of many ranks at once)."""
        return {s for s, nexts in cls.TRANSITIONS.items() if to in nexts}

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="ranks")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="ranks")
    rank = models.PositiveSmallIntegerField(help_text="--node-rank (the head is 0).")
    gpu_indices = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    message = models.TextField(blank=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment", "rank"]
        constraints = [models.UniqueConstraint(fields=["deployment", "rank"], name="rank_unique_per_deployment"),
                       models.UniqueConstraint(fields=["deployment", "node"], name="rank_one_per_node")]

    def __str__(self):
        return f"{self.deployment} rank {self.rank} on {self.node}"

    @property
    def name(self) -> str:
        return f"{self.deployment.name} rank {self.rank} ({self.node.name})"


class DeploymentEvent(models.Model):
    """One step on a deployment's timeline, with its start, end and message."""

    class Level(models.TextChoices):
        INFO = "info", "Info"
        WARNING = "warning", "Warning"
        ERROR = "error", "Error"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")
    step = models.CharField(max_length=64)
    message = models.TextField(blank=True)
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    started = models.DateTimeField(default=timezone.now)
    ended = models.DateTimeField(null=True, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["started", "id"]

    def __str__(self):
        return f"{self.deployment}: {self.step}"

    @property
    def duration(self):
        if self.ended is None:
            return None
        return (self.ended - self.started).total_seconds()


class NodeMetric(models.Model):
    """One minute of a node's telemetry (averages and peaks); the last hour at 1 s lives in Redis."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="metrics")
    t = models.DateTimeField(help_text="Start of the minute.")
    data = models.JSONField(help_text='{"gpus": [{"index", "memory_used", "memory_used_max", "util_gpu", ...}], "disk_free", ...}')

    class Meta:
        ordering = ["node", "t"]
        constraints = [models.UniqueConstraint(fields=["node", "t"], name="metric_unique_minute")]

    def __str__(self):
        return f"{self.node} @ {self.t:%Y-%m-%d %H:%M}"


class Recipe(models.Model):
    """A recipe or strategy file in vllm-project/recipes' YAML layout, as read and checked (deployments/recipes/),
    with where it came from: the shipped folder, RECIPES_DIR, or an import from a checkout."""

    class Kind(models.TextChoices):
        MODEL = "model", "model recipe"
        STRATEGY = "strategy", "strategy"

    kind = models.CharField(max_length=16, choices=Kind.choices)
    name = models.CharField(max_length=200, help_text="The model id (models/<org>/<model>.yaml) or strategy name.")
    source = models.CharField(max_length=300, help_text="panel (shipped), folder:<path> (RECIPES_DIR) or import:<name>.")
    version = models.CharField(max_length=80, blank=True, help_text="The checkout's git commit, else the file's sha256.")
    path = models.CharField(max_length=400, help_text="The file's path inside its source.")
    digest = models.CharField(max_length=64, help_text="sha256 of the file's text.")
    data = models.JSONField(help_text="The file's YAML as read (checked by deployments/recipes/schema.py).")
    loaded = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["kind", "name", "source"]
        constraints = [models.UniqueConstraint(fields=["kind", "name", "source"], name="recipe_unique_per_source")]

    def __str__(self):
        return f"{self.name} ({self.source})"


class FitCalibration(models.Model):
    """One load's KV-cache estimate against the figure its engine logged: the error, and the
    correction of the engine's reserve per GPU it implies, which the next estimate for this node and model uses."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="fit_calibrations")
    model = models.ForeignKey(ModelRepo, on_delete=models.CASCADE, related_name="fit_calibrations")
    deployment = models.ForeignKey(Deployment, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    layout = models.CharField(max_length=100, help_text="The layout and KV dtype estimated: 'TP 8 × DCP 8, fp8'.")
    predicted_tokens = models.BigIntegerField()
    observed_tokens = models.BigIntegerField(help_text="The engine's own 'KV cache size: N tokens'.")
    error = models.FloatField(help_text="(predicted - observed) / observed, before this correction.")
    correction_bytes = models.BigIntegerField(help_text="Added to the reserve per GPU by the next estimate.")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created", "-id"]

    def __str__(self):
        return f"{self.model} on {self.node}: {self.error:+.1%}"
