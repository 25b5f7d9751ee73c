"""The host doctor on the node page and the context fit with the host warnings on the deploy page, as
inclusion tags: each computes what it shows from the page's own context, so the views stay as
they are."""
from django import template

from deployments import deploydefaults, flagpolicy, forms
from deployments.services import contextfit, doctor

register = template.Library()
BADGES = {"pass": "ok", "warn": "busy", "fail": "bad", "unknown": ""}


@register.inclusion_tag("deployments/_doctor.html")
def host_doctor(node):
    report = node.host_checks or {}
    checks = [dict(c, badge=BADGES.get(c.get("status"), "")) for c in report.get("checks") or []]
    topology = next((c.get("data") or {} for c in checks if c["name"] == "topology"), {})
    return {"report": report, "checks": checks, "pairs": topology.get("pairs") or [],
            "presets": report.get("nccl_presets") or [], "failing": sum(c["status"] == "fail" for c in checks)}


@register.inclusion_tag("deployments/_context_fit.html", takes_context=True)
def deploy_context_fit(context):
    """The context table and host warnings for what the deploy form would deploy (its values, or its initial
    ones unchanged), on a single node; nothing for a multi-node placement (each node's share is the plan's)."""
    model, node, form = context.get("model"), context.get("node"), context.get("form")
    if not (model and node and form):
        return {}
    checked = form if form.is_bound else forms.DeployForm(
        data=deploydefaults.submitted(form, keep=("gpus", "port", "workers")), node=node)
    if not checked.is_valid() or checked.cleaned_data.get("placement"):
        return {}
    data = checked.cleaned_data
    use = context.get("recipe_use")
    recipe = getattr(use, "row", None) if use is not None and not isinstance(use, dict) else (use or {}).get("row")
    fit = contextfit.deploy_context(model, node, data["engine_args"], data["env_vars"],
                                    gpu_indices=data["gpu_indices"] or None, recipe=recipe)
    warnings = doctor.layout_warnings(node, data["engine_args"], data["env_vars"])
    try:
        multi = contextfit.layout_of(data["engine_args"]).gpus > 1  # NCCL presets matter between GPUs only
    except (ValueError, flagpolicy.OptionError):
        multi = False
    return {"context_fit": fit, "host_warnings": warnings, "node": node,
            "presets": ((node.host_checks or {}).get("nccl_presets") or []) if multi else []}
