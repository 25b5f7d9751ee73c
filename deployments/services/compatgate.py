"""The compatibility gate before a load: the recipe's minimum vLLM against the node's engine, the variant's
minimum GPU memory against the chosen GPUs, and the combinations known to fail (the recipes' own and the
panel's table in deployments/recipes/compat.py) refuse a deploy with the reason and the fix, unless an admin
overrides it, which the timeline records (as the fit gate does, services/fitgate.py)."""
from dataclasses import dataclass

from deployments.models import Deployment, ModelRepo, Node, Recipe
from deployments.recipes import compat, resolve, schema
from deployments.services import recipes
from deployments.services.gateoverride import GateOverride, gate_override
from plumbing.errors import ServiceError

__all__ = ["Option", "refusals", "compat_gate", "recipe_options", "OVERRIDE_HINT"]
OVERRIDE_HINT = ("an admin can deploy it anyway (the form's \"Deploy anyway, against the compatibility check\", "
                 "API: override_compat, panelctl: --override-compat)")


def refusals(model: ModelRepo, node: Node, flags: dict, env: dict, *, recipe: schema.Recipe | None = None,
             variant: str = "", strategy: str = "", gpu_bytes: int = 0, gpus: int = 0,
             gpu_indices: list[int] | None = None) -> list[compat.Refusal]:
    """Every reason these flags would fail on the node's GPUs (those chosen, else all). Without a chosen recipe
    the recipes serving the model still count: their failures (those not about a strategy or variant) and
    the lowest minimum vLLM among them."""
    capability = resolve.Target.of_node(node, gpu_indices or None).capability
    out = []
    if recipe is not None:
        out += compat.check_version(recipe, node.engine_version)
        out += compat.check_recipe(recipe, flags, env, capability, variant, strategy)
        out += compat.check_vram(recipe, variant, gpu_bytes, gpus)
    else:
        matching = [r for _, r, _ in recipes.recipes_for_model(model)]
        oldest = min(matching, key=lambda r: compat.version_tuple(r.min_vllm_version), default=None)
        if oldest:
            out += compat.check_version(oldest, node.engine_version)
        for r in matching:
            out += compat.check_recipe(r, flags, env, capability)
    out += compat.check_flags(flags, env, compat.Shape.of_config(model.config or {}, model.attention), capability)
    return list({r.text(): r for r in out}.values())


def compat_gate(model: ModelRepo, node: Node, gpu_indices: list[int], engine_args: dict, env: dict, *,
                resolved=None, nnodes: int = 1, gpu_bytes: int = 0, override: bool = False, admin: bool = False,
                deployment: Deployment | None = None) -> GateOverride | None:
    """Refuse (409 incompatible, each reason with its fix) what would fail before the load, unless an admin
    overrides it: then the override to record on the timeline. `resolved` is the recipe the deploy used
    (resolve.Resolved), if any. A redeploy an admin already overrode for these same reasons keeps it."""
    found = refusals(model, node, engine_args, env, recipe=resolved.recipe if resolved else None,
                     variant=resolved.variant if resolved else "", strategy=resolved.strategy if resolved else "",
                     gpu_bytes=gpu_bytes, gpus=len(gpu_indices) * nnodes, gpu_indices=gpu_indices)
    if not found:
        return None
    verdict = "; ".join(r.text() for r in found)
    refusal = ServiceError(f"{model} would fail on {node}: {verdict}. {OVERRIDE_HINT[0].upper()}{OVERRIDE_HINT[1:]}.",
                           field="recipe", code="incompatible")
    return gate_override(refusal, check="the compatibility check", step="compat_override", verdict=verdict,
                         says=f": {verdict}", data={"verdict": verdict, "codes": [r.code for r in found]},
                         override=override, admin=admin, deployment=deployment, override_field="override_compat")


@dataclass
class Option:
    """One recipe, variant and strategy for a node: its flags with reasons, and what the gate says of it."""

    row: Recipe
    choice: recipes.Choice
    resolved: resolve.Resolved
    refusals: list


def recipe_options(model: ModelRepo, node: Node, nnodes: int = 1) -> tuple[list[Option], list[str]]:
    """Every variant × strategy of the recipes matching the model that applies to the node's GPUs, resolved;
    and why the others do not apply (for the page)."""
    _, strategies = recipes.recipes_loaded()
    target = resolve.Target.of_node(node, nnodes=nnodes)
    options, skipped = [], []
    for row, recipe, variants in recipes.recipes_for_model(model):
        plans = recipes.strategies_for(row, strategies)
        for variant in variants:
            for name in recipe.strategies:
                try:
                    resolved = resolve.resolve(recipe, plans, variant, name, target)
                except resolve.ResolveError as exc:
                    skipped.append(f"{recipe.model_id} · {variant} · {name}: {exc}")
                    continue
                found = refusals(model, node, resolved.flags, resolved.env, recipe=recipe, variant=variant, strategy=name,
                                 gpu_bytes=recipes.gpu_bytes(node, resolved.gpus) * nnodes, gpus=resolved.gpus * nnodes)
                options.append(Option(row, recipes.Choice(row.pk, variant, name), resolved, found))
    return options, skipped
