"""Models: repositories known to the panel, their copies on nodes, and the secrets they are fetched with."""

from django.db import models

from deployments.models.hosts import Node
from plumbing.states import Transitions


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
