"""Forms for the pages; the same validators back the API serializers."""
import re
from typing import NamedTuple

from django import forms

from deployments import flagpolicy, secrets, userflags, validators
from deployments.models import Deployment, ModelCopy, Node


class Placement(NamedTuple):
    """A worker node ticked on the deploy form and its GPUs (the view makes it a multinode.Worker)."""

    node: Node
    gpu_indices: list[int]


class ModelAddForm(forms.Form):
    repo_id = forms.CharField(label="Hugging Face repo", max_length=200, validators=[validators.validate_repo_id],
                              widget=forms.TextInput(attrs={"placeholder": "moonshotai/Kimi-K2.5"}))
    revision = forms.CharField(max_length=200, required=False, initial="main", validators=[validators.validate_revision])


class LocalModelForm(forms.Form):
    node = forms.ModelChoiceField(queryset=Node.objects.all())
    path = forms.CharField(label="Folder on the node", max_length=1024, validators=[validators.validate_local_path],
                           widget=forms.TextInput(attrs={"placeholder": "/models/my-model"}),
                           help_text="Below the node's model store or a folder its admin declared (LOCAL_MODEL_ROOTS on "
                                     "its agent); read as the engine user.")


class DownloadForm(forms.Form):
    # No empty choice: with one node (the first hour's case) Download works without touching the field.
    node = forms.ModelChoiceField(queryset=Node.objects.all(), empty_label=None)

    def __init__(self, *args, model=None, **kwargs):
        super().__init__(*args, **kwargs)
        if model is not None:  # only nodes a download can go to: none that holds it, fetches it or deletes it
            held = model.copies.exclude(state__in=(ModelCopy.State.FAILED, ModelCopy.State.CANCELLED)).values("node")
            self.fields["node"].queryset = Node.objects.exclude(pk__in=held)


class FitForm(forms.Form):
    tp = forms.TypedChoiceField(label="Tensor parallel", coerce=int, choices=[(n, n) for n in (1, 2, 4, 8, 16)], initial=1)
    kv_cache_dtype = forms.ChoiceField(label="KV cache", choices=[(c, c) for c in flagpolicy.KV_CACHE_DTYPES],
                                       initial=flagpolicy.KV_CACHE_DTYPE)


class HfTokenForm(forms.Form):
    # Write-only: the field is never pre-filled and the value never rendered back.
    hf_token = forms.CharField(label="Hugging Face token", required=False, max_length=256,
                               widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}))
    clear = forms.BooleanField(required=False)


class DeployForm(forms.Form):
    """The deploy form for one model on one node; `clean()` yields engine flags and environment."""

    name = forms.SlugField(max_length=80, required=False, help_text="Default: model and node.")
    gpus = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple, label="GPUs")
    port = forms.IntegerField(min_value=1024, max_value=65535,
                              help_text="Default: the first port free on the node (never the panel's own).")
    tp = forms.IntegerField(label="Tensor parallel", min_value=1, max_value=64, initial=1)
    pp = forms.IntegerField(label="Pipeline parallel", min_value=1, max_value=64, initial=1)
    dp = forms.IntegerField(label="Data parallel (replicas)", min_value=1, max_value=64, initial=1,
                            help_text="Replicas of TP × PP GPUs each; over several nodes each node runs whole replicas.")
    expert_parallel = forms.BooleanField(required=False, label="Expert parallel (MoE)")
    max_model_len = forms.IntegerField(required=False, min_value=16, max_value=10_000_000, label="Max model length")
    gpu_memory_utilization = forms.FloatField(min_value=0.05, max_value=0.99, initial=flagpolicy.GPU_MEMORY_UTILIZATION,
                                              label="GPU memory utilization")
    max_num_seqs = forms.IntegerField(required=False, min_value=1, max_value=65536, label="Max concurrent sequences")
    max_num_queued_reqs = forms.IntegerField(
        required=False, min_value=1, max_value=1_000_000, label="Refuse beyond this many requests",
        help_text="vLLM's --max-num-queued-reqs: running and waiting requests at most; more are refused at once (the "
                  "gateway answers 429 with Retry-After) rather than queued for minutes of time to first token.")
    max_num_queued_tokens = forms.IntegerField(
        required=False, min_value=1, max_value=1_000_000_000, label="Refuse beyond this many prompt tokens waiting",
        help_text="vLLM's --max-num-queued-tokens: prompt tokens waiting for prefill at most (a bound on time to first "
                  "token); more are refused at once.")
    kv_cache_dtype = forms.ChoiceField(choices=[(c, c) for c in flagpolicy.KV_CACHE_DTYPES],
                                       initial=flagpolicy.KV_CACHE_DTYPE, label="KV-cache dtype")
    attention_backend = forms.ChoiceField(required=False, label="Attention backend", choices=[("", "engine default")] + [
        (b, b) for b in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLASHMLA", "CUTLASS_MLA", "TRITON_MLA", "FLEX_ATTENTION")])
    reasoning_parser = forms.CharField(required=False, max_length=64, help_text="e.g. deepseek_r1, qwen3, kimi_k2")
    tool_call_parser = forms.CharField(required=False, max_length=64, help_text="e.g. hermes, kimi_k2 (enables auto tool choice)")
    trust_remote_code = forms.BooleanField(required=False, label="⚠ Trust remote code",
                                           help_text="Runs Python code from the model repository on the host: admins only.")
    served_model_name = forms.CharField(required=False, max_length=200)
    extra_flags = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}),
                                  help_text="More engine flags, e.g. --enable-prefix-caching --max-num-batched-tokens 8192. "
                                            "Operators may set those on the operator list above; the others need an admin.")
    env = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}), label="Environment",
                          help_text="NAME=VALUE per line: NCCL_*, VLLM_*, CUDA_*, TORCH_*, … (operators: NCCL_* and "
                                    "the variables on the operator list above)")
    secret_env = forms.CharField(required=False, max_length=2000, label="Secret variables",
                                 help_text="Names from Environment to keep secret, e.g. MY_VAR OTHER_VAR: never shown "
                                           "again, kept out of unit text and logs (*_TOKEN, *_KEY, … are secret anyway).")
    replace = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple,
                                        label="Also stop", help_text="Deployments on the chosen GPUs are stopped anyway.")
    auto_restart = forms.BooleanField(required=False, label="Restart automatically after a crash (with backoff)")
    retry_advised = forms.BooleanField(required=False, initial=True, label="Retry once with the advised setting",
                                       help_text="When the start runs out of memory or KV cache and the engine's log "
                                                 "says what fits, start once more with it (the timeline says so).")
    stop_foreign = forms.BooleanField(required=False, label="Stop other processes on these GPUs",
                                      help_text="Processes the panel did not start (never display servers). "
                                                "Without this, a deploy onto GPUs others use is refused, naming them.")
    prewarm = forms.BooleanField(required=False, label="Pre-warm: read the model into the page cache first",
                                 help_text="In parallel, while other engines stop and before launch, when free RAM allows.")
    reuse_memory_profile = forms.BooleanField(
        required=False, label="Reuse the last memory profile (skip profiling)",
        help_text="Start with the KV cache size the last load of this model, GPUs, settings and engine chose "
                  "(--kv-cache-memory-bytes); refused when none matches.")
    sleep_mode = forms.BooleanField(required=False, label="Sleep mode: can sleep, wake and swap on these GPUs",
                                    help_text="vLLM's sleep mode (CUDA GPUs, one node). Sleep-mode deployments share GPUs, "
                                              "one awake at a time: swapping between them takes seconds, not a load. "
                                              "Admins only: it opens vLLM's development routes to local processes.")
    start_asleep = forms.BooleanField(required=False, label="Start asleep (ready to be swapped to)",
                                      help_text="Loaded, smoke-tested, then put to sleep; one serving on these GPUs sleeps "
                                                "meanwhile and wakes again after.")
    workers = forms.MultipleChoiceField(required=False, widget=forms.CheckboxSelectMultiple, label="Also on nodes (multi-node)",
                                        help_text="This node is the head (rank 0); each node ticked runs a headless rank. "
                                                  "With DP 1, TP × PP is split evenly over all of them; with DP > 1, "
                                                  "each node runs its GPUs / (TP × PP) replicas (CPU nodes: DP / nodes).")
    worker_gpus = forms.CharField(required=False, max_length=2000, label="GPUs on the other nodes",
                                  help_text="node=0,1,2,3 per node, space-separated (default: as many as here, from GPU 0; "
                                            "none on a CPU node).")
    master_port = forms.IntegerField(required=False, min_value=1024, max_value=65535, label="Master port (multi-node)",
                                     help_text="The head's port the ranks meet at, its DP RPC port with DP > 1 "
                                               "(default: the first free from 29500).")
    stall_seconds = forms.IntegerField(min_value=30, max_value=86400, initial=600, label="Stalled after (s)",
                                       help_text="No fixed load timeout: a load fails only when neither log nor GPU memory moved this long.")
    override_fit = forms.BooleanField(required=False, label="Deploy anyway, against the fit check (admins)",
                                      help_text="Recorded on the deployment's timeline.")
    override_compat = forms.BooleanField(required=False, label="Deploy anyway, against the compatibility check (admins)",
                                         help_text="Recorded on the deployment's timeline.")
    # The recipe that filled the form ("id:variant:strategy", deployments/services/recipes.py), for the gate and
    # the timeline; the flags above are what is deployed.
    recipe = forms.CharField(required=False, max_length=300, widget=forms.HiddenInput)

    # Fields that mean nothing on a node without GPUs, and those of a deploy over several nodes: sent as
    # they are (their defaults), not shown where they cannot apply (~24 fields on a CPU node).
    # Hidden on a node without GPUs: sleep mode is CUDA's, and a memory profile is what a GPU load measured.
    GPU_FIELDS = ("gpus", "tp", "pp", "expert_parallel", "gpu_memory_utilization", "attention_backend", "sleep_mode",
                  "start_asleep", "reuse_memory_profile")
    MULTI_NODE_FIELDS = ("workers", "worker_gpus", "master_port")

    PARSER = re.compile(r"^[A-Za-z0-9_.-]*$")

    def __init__(self, *args, node: Node, **kwargs):
        super().__init__(*args, **kwargs)
        self.node = node
        self.fields["gpus"].choices = [(str(g.index), f"GPU {g.index} · {g.name}") for g in node.gpus.all()]
        others = node.deployments.filter(status__in=Deployment.ACTIVE)
        self.fields["workers"].choices = [(n.name, n.name + ("" if n.online else " (offline)"))
                                          for n in Node.objects.exclude(pk=node.pk)]
        self.fields["replace"].choices = [(str(d.pk), f"{d.name} ({d.get_status_display().lower()})") for d in others]
        hidden = () if node.gpus.exists() else (*self.GPU_FIELDS, "dp" if not self.fields["workers"].choices else "")
        if not self.fields["workers"].choices:
            hidden = (*hidden, *self.MULTI_NODE_FIELDS)
        for name in filter(None, hidden):
            multiple = isinstance(self.fields[name], forms.MultipleChoiceField)
            self.fields[name].widget = forms.MultipleHiddenInput() if multiple else forms.HiddenInput()
        if not node.gpus.exists():
            self.fields["stop_foreign"].label = "Stop other vLLM engines on this node"
            self.fields["stop_foreign"].help_text = ("Engines the panel did not start. Without this, a deploy onto a node "
                                                     "that runs one is refused, naming it.")

    def clean(self):
        data = super().clean()
        for field in ("reasoning_parser", "tool_call_parser"):
            if data.get(field) and not self.PARSER.match(data[field]):
                self.add_error(field, "Letters, digits, '_', '-', '.' only.")
        if self.errors:
            return data
        flags = {"tensor-parallel-size": data["tp"], "gpu-memory-utilization": data["gpu_memory_utilization"]}
        if data["pp"] > 1:
            flags["pipeline-parallel-size"] = data["pp"]
        if data["dp"] > 1:
            flags["data-parallel-size"] = data["dp"]
        optional = {"enable-expert-parallel": data["expert_parallel"], "max-model-len": data["max_model_len"],
                    "max-num-seqs": data["max_num_seqs"], "reasoning-parser": data["reasoning_parser"],
                    "max-num-queued-reqs": data["max_num_queued_reqs"],
                    "max-num-queued-tokens": data["max_num_queued_tokens"],
                    "tool-call-parser": data["tool_call_parser"], "enable-auto-tool-choice": bool(data["tool_call_parser"]),
                    "trust-remote-code": data["trust_remote_code"], "served-model-name": data["served_model_name"],
                    "kv-cache-dtype": data["kv_cache_dtype"] if data["kv_cache_dtype"] != flagpolicy.KV_CACHE_DTYPE else None}
        flags.update({k: v for k, v in optional.items() if v not in (None, "", False)})
        env = {}
        try:
            extra = userflags.parse_flags(data["extra_flags"])
            env = userflags.parse_env(data["env"])
        except userflags.ArgsError as exc:
            for field, message in exc.errors.items():
                self.add_error(field, message)
            return data
        clash = sorted(set(extra) & set(flags))
        if clash:
            self.add_error("extra_flags", f"--{clash[0]} is set by the form above; change it there.")
        flags.update(extra)
        if data["attention_backend"]:
            if "--attention-backend" in set(self.node.engine_flags):
                flags["attention-backend"] = data["attention_backend"]
            else:
                env["VLLM_ATTENTION_BACKEND"] = data["attention_backend"]
        for field, message in {**userflags.check_flags(flags, set(self.node.engine_flags) or None,
                                                       self.node.engine_modules),
                               **userflags.check_env(env)}.items():
            self.add_error(field, message)
        data["engine_args"], data["env_vars"] = flags, env
        data["secret_names"] = [n for n in re.split(r"[\s,]+", data.get("secret_env") or "") if n]
        if problem := secrets.check_marked(data["secret_names"], env):
            self.add_error("secret_env", problem)
        data["gpu_indices"] = sorted(int(i) for i in data["gpus"])
        data["replace_ids"] = [int(i) for i in data["replace"]]
        data["placement"] = self._placement(data)
        return data

    WORKER_GPUS = re.compile(r"^([a-z0-9-]+)=(\d{1,4}(?:,\d{1,4})*)?$")

    def _placement(self, data) -> list[Placement]:
        """The worker nodes ticked and their GPUs."""
        given = {}
        for word in (data.get("worker_gpus") or "").split():
            match = self.WORKER_GPUS.match(word)
            if not match or match.group(1) not in data["workers"]:
                self.add_error("worker_gpus", f"{word[:40]!r}: write node=0,1 for a node ticked above.")
                return []
            given[match.group(1)] = sorted({int(i) for i in (match.group(2) or "").split(",") if i})
        workers = []
        for node in Node.objects.filter(name__in=data["workers"]).order_by("name"):
            default = [g.index for g in node.gpus.all()][: len(data["gpu_indices"])]
            workers.append(Placement(node, given.get(node.name, default)))
        return workers
