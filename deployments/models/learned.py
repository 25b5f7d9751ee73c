"""What the panel learnt and read: recipes as loaded, the fit check's calibrations from real loads, and sleep probes."""
import hashlib
import json

from django.db import models

from deployments.models.engines import Deployment
from deployments.models.hosts import Node
from deployments.models.store import ModelRepo


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


GIB = 1 << 30

# Flags whose value changes what an engine holds on its GPUs or in host RAM: a sleep probe proves sleep mode for one
# set of them (with the model's commit, the engine's version and the GPUs); any other flag leaves the proof standing.
MEMORY_FLAGS = frozenset({
    "block-size", "calculate-kv-scales", "compilation-config", "cpu-offload-gb", "cuda-graph-sizes",
    "data-parallel-size", "dtype", "enable-expert-parallel", "enable-prefix-caching", "enforce-eager",
    "gpu-memory-utilization", "kv-cache-dtype", "kv-cache-memory-bytes", "limit-mm-per-prompt", "load-format",
    "max-model-len", "max-num-batched-tokens", "max-num-seqs", "mm-encoder-tp-mode", "pipeline-parallel-size",
    "quantization", "swap-space", "tensor-parallel-size"})


class SleepProbe(models.Model):
    """Sleep mode tried before it is trusted (deployments/node/sleepprobe.py): for one combination of model commit,
    engine version, memory flags and GPUs, each level slept and woken with the GPU memory NVML saw before, asleep and
    after, the host RAM taken, and whether a fixed prompt at temperature 0 answered the same after the wake. Sleep
    and swaps use only the levels a probe of their combination passed."""

    class Verdict(models.TextChoices):
        RUNNING = "running", "running"
        PASSED = "passed", "passed"
        FAILED = "failed", "failed"

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="sleep_probes")
    model = models.ForeignKey(ModelRepo, on_delete=models.CASCADE, related_name="sleep_probes")
    deployment = models.ForeignKey(Deployment, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    key = models.CharField(max_length=64, db_index=True, help_text="sha256 of `combination`.")
    combination = models.JSONField(help_text="Model commit, engine version, memory flags and GPUs the probe proves.")
    verdict = models.CharField(max_length=8, choices=Verdict.choices, default=Verdict.RUNNING)
    levels = models.JSONField(default=list, blank=True, help_text="Per level: seconds, GPU bytes before/asleep/after "
                              "per GPU, host RAM taken, answer identical, problems; or why it was not tried.")
    reason = models.TextField(blank=True, help_text="Why it failed, with its figures.")
    created = models.DateTimeField(auto_now_add=True)
    ended = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created", "-id"]

    def __str__(self):
        return f"sleep probe of {self.model} on {self.node}: {self.verdict}"

    @staticmethod
    def combination_of(d: Deployment) -> dict:
        """What a deployment's sleep depends on: its model's commit, its node's engine, memory flags and GPUs."""
        flags = {k: v for k, v in sorted((d.engine_args or {}).items()) if k in MEMORY_FLAGS}
        return {"model": d.model.repo_id, "commit": d.model.commit or d.model.revision, "node": d.node.name,
                "engine": d.node.engine_version or "", "flags": flags, "gpus": sorted(d.gpu_indices)}

    @classmethod
    def key_of(cls, d: Deployment) -> str:
        return hashlib.sha256(json.dumps(cls.combination_of(d), sort_keys=True, default=str).encode()).hexdigest()

    @classmethod
    def last_for(cls, d: Deployment) -> "SleepProbe | None":
        """The last probe of this deployment's combination, a running one included (None: never probed)."""
        return cls.objects.filter(key=cls.key_of(d)).first()

    @classmethod
    def latest_for(cls, d: Deployment) -> "SleepProbe | None":
        """The last finished probe of this deployment's combination (None: never proved)."""
        return cls.objects.filter(key=cls.key_of(d)).exclude(verdict=cls.Verdict.RUNNING).first()

    def passed_levels(self) -> list[int]:
        return [r["level"] for r in self.levels if r.get("passed")] if self.verdict == self.Verdict.PASSED else []

    def summary(self) -> str:
        """One sentence per level: what it took and what it freed, or why it failed or was not tried."""
        said = []
        for r in self.levels:
            if not r.get("tried"):
                said.append(f"level {r['level']} not tried: {r.get('why', '')}")
                continue
            if "gpu_before" not in r:
                said.append(f"level {r['level']} {'passed' if r.get('passed') else 'failed'}")
                continue
            freed = {i: r["gpu_before"].get(i, 0) - b for i, b in r["gpu_asleep"].items()}
            memory = (", ".join(f"GPU {i} {b / GIB:.2f} GiB freed" for i, b in sorted(freed.items()))
                      or "no GPU memory to read: only the answer was compared")
            verdict = "passed" if r["passed"] else "failed: " + "; ".join(r["problems"])
            said.append(f"level {r['level']} {verdict} (sleep {r['sleep_s']:.2f} s, wake {r['wake_s']:.2f} s; "
                        f"{memory}; host RAM taken {r['ram_taken_bytes'] / GIB:.2f} GiB)")
        return ". ".join(said) + "." if said else ""
