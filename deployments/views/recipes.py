"""Recipes on the pages: on a model's page the recipes that match it and a node's GPUs, each flag with
its reason and the compatibility gate's verdict; on the deploy page the form filled from a recipe, variant and
strategy, the recipe's reasons beside it and the gate's refusals for the values shown."""
from django.contrib import messages

from deployments import callit, deploydefaults, forms
from deployments.models import Node
from deployments.services import compatgate, recipes
from plumbing.errors import ServiceError


def model_recipes(request, model, nodes: list[Node]) -> dict:
    """Context for templates/deployments/_recipes.html: the node picked (?recipe_node=, else the first with GPUs,
    else the first), its options, why other strategies do not apply, and load errors of the recipes folder."""
    picked = next((n for n in nodes if str(n.pk) == request.GET.get("recipe_node")), None)
    node = picked or next((n for n in nodes if n.gpus.all()), nodes[0] if nodes else None)
    errors = recipes.recipes_sync()
    if node is None:
        return {"recipe_node": None, "recipe_options": [], "recipe_skipped": [], "recipe_errors": errors}
    options, skipped = compatgate.recipe_options(model, node)
    return {"recipe_node": node, "recipe_nodes": nodes, "recipe_options": options, "recipe_skipped": skipped,
            "recipe_errors": errors}


def deploy_initial(request, model, node) -> tuple[dict | None, recipes.Use | None]:
    """The deploy form's initial values from ?recipe=&variant=&strategy= for this node (None without one; a
    choice that does not apply is said above the form and the preset is used)."""
    if not request.GET.get("recipe"):
        return None, None
    try:
        use = recipes.recipe_use(recipes.recipe_choice(request.GET["recipe"], request.GET.get("variant", ""),
                                                       request.GET.get("strategy", "")), node)
    except ServiceError as exc:
        messages.error(request, exc.message)
        return None, None
    r = use.resolved
    return {**deploydefaults.flags_initial(r.flags, r.env), "served_model_name": callit.served_name(model),
            "gpus": [str(i) for i in use.gpu_indices], "recipe": f"{use.row.pk}:{r.variant}:{r.strategy}"}, use


def deploy_context(model, node, form, use=None) -> dict:
    """The recipe that filled the form (its flags with their reasons) and the gate's refusals for what the form
    would deploy (its values, or its initial ones unchanged)."""
    value = form["recipe"].value()
    if value and use is None:
        try:
            use = recipes.recipe_use(recipes.recipe_choice(value), node)
        except ServiceError:  # the recipe went away since the form was filled: the flags stand on their own
            use = None
    checked = form if form.is_bound else forms.DeployForm(
        data=deploydefaults.submitted(form, keep=("gpus", "port", "workers")), node=node)
    found = []
    checked.is_valid()  # a service's refusal added since leaves the values as cleaned
    data = getattr(checked, "cleaned_data", None) or {}
    if "engine_args" in data and "gpu_indices" in data:
        r = use.resolved if use else None
        chosen = data["gpu_indices"]
        found = compatgate.refusals(model, node, data["engine_args"], data["env_vars"], recipe=r and r.recipe,
                                    variant=r.variant if r else "", strategy=r.strategy if r else "",
                                    gpu_bytes=recipes.gpu_bytes(node, len(chosen), chosen), gpus=len(chosen),
                                    gpu_indices=chosen)
    return {"recipe_use": use, "incompatible": found, "compat_hint": compatgate.OVERRIDE_HINT,
            "override_compat": form["override_compat"]}


def deploy_kwargs(data: dict) -> dict:
    """What deployment_create takes from the form for the recipe and the gate."""
    return {"recipe": recipes.recipe_choice(data["recipe"]) if data.get("recipe") else None,
            "override_compat": data.get("override_compat", False)}
