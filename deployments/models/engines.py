"""Engines: an engine process the panel launched (a deployment's head or a worker rank) and its timeline."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from deployments.models.hosts import Gpu, Node
from deployments.models.store import ModelRepo
from plumbing.states import Transitions


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
        SLEEPING = "sleeping", "Sleeping"
        STOPPING = "stopping", "Stopping"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    ACTIVE = frozenset(
        {Status.QUEUED, Status.PREPARING, Status.STOPPING_OTHERS, Status.STARTING, Status.LOADING, Status.READY,
         Status.SLEEPING, Status.STOPPING}
    )
    TERMINAL = frozenset({Status.STOPPED, Status.FAILED})
    # On its way somewhere: its GPUs cannot be taken, nor the deployment redeployed, until it arrives.
    IN_FLIGHT = ACTIVE - {Status.READY, Status.SLEEPING}
    # An engine that is up: serving (ready) or loaded and asleep (sleep mode: its weights in host RAM or dropped).
    UP = frozenset({Status.READY, Status.SLEEPING})
    # Where each status may go next. Any active status may fail or be stopped.
    TRANSITIONS = {
        Status.QUEUED: {Status.PREPARING, Status.STOPPING, Status.FAILED},
        Status.PREPARING: {Status.STOPPING_OTHERS, Status.STARTING, Status.STOPPING, Status.FAILED},
        Status.STOPPING_OTHERS: {Status.STARTING, Status.STOPPING, Status.FAILED},
        Status.STARTING: {Status.LOADING, Status.STOPPING, Status.FAILED},
        Status.LOADING: {Status.READY, Status.STOPPING, Status.FAILED},
        Status.READY: {Status.STOPPING, Status.FAILED, Status.LOADING, Status.QUEUED, Status.SLEEPING},
        Status.SLEEPING: {Status.READY, Status.STOPPING, Status.FAILED, Status.QUEUED},
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
    engine_key = models.CharField(max_length=256, blank=True, help_text="The engine's own --api-key: random per "
                                  "deployment, known to the panel and its gateways only; sealed at rest; never shown.")
    stop_foreign = models.BooleanField(default=False, help_text="Stop other (non-panel) processes on the chosen GPUs.")
    prewarm = models.BooleanField(default=False, help_text="Read the model's shards into the page cache while others stop.")
    expires_at = models.DateTimeField(null=True, blank=True, help_text="A queued plan not started by then is dropped.")
    auto_restart = models.BooleanField(default=False)
    restarts = models.PositiveIntegerField(default=0)
    retry_advised = models.BooleanField(default=False, help_text="When a start fails for a memory cause with a certain "
                                        "fix (deployments/host/startcauses.py), start once more with it; used up then.")
    replace = models.JSONField(default=list, blank=True, help_text="Deployments the plan stops first (ids).")
    stall_seconds = models.PositiveIntegerField(default=600, help_text="Fail a load when neither log nor GPU memory moved for this long.")
    master_port = models.PositiveIntegerField(null=True, blank=True,
                                              help_text="Multi-node: the head's --master-port the worker ranks join.")
    load_detail = models.JSONField(default=dict, blank=True, help_text="Shards, seconds left, ...")
    sleep_mode = models.BooleanField(default=False, help_text="Started with vLLM's sleep mode: it can sleep and wake "
                                     "on its GPUs, so another deployment of them can be swapped to in seconds.")
    start_asleep = models.BooleanField(default=False, help_text="Put to sleep once loaded and smoke-tested: ready "
                                       "to be swapped to.")
    sleep_level = models.PositiveSmallIntegerField(null=True, blank=True, help_text="While asleep: 1 (weights in "
                                                   "host RAM) or 2 (weights dropped, reloaded at wake).")
    sleep_ram_bytes = models.BigIntegerField(null=True, blank=True, help_text="Host RAM its weights hold while asleep.")
    reuse_memory_profile = models.BooleanField(default=False, help_text="Start with the KV cache size the last load of "
                                               "the same settings chose (--kv-cache-memory-bytes): no profiling run.")
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

    @property
    def badge(self) -> str:
        """The status as its badge says it: "Crashed" for a failure the crash watch found (node/crashes.py)."""
        if self.status == self.Status.FAILED and (self.status_message or "").startswith("Crashed"):
            return "Crashed"
        return self.get_status_display()

    def transition(self, to, message: str = "", **fields) -> None:
        """Move to `to` with `message` as the status message (cleared when none), or raise InvalidTransition."""
        super().transition(to, status_message=message, **fields)

    def entered(self, status) -> None:
        self._start_ended = status in (self.Status.READY, *self.TERMINAL)  # the next save settles its version
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
        scheme = "https" if settings.GATEWAY_TLS_CERT else "http"
        return f"{scheme}://{host}:{self.node.gateway_port or settings.GATEWAY_PORT}"

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
