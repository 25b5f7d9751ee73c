"""What the panel learnt and read: recipes as loaded, and the fit check's calibrations from real loads."""

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
