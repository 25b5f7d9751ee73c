"""How much context a deploy holds on a node, shown before Deploy. The arithmetic is
deployments/contextfit.py; here: a node's GPUs (or RAM), the deploy's flags, the recipe's KV dtypes and DCP
sizes, and the corrections learnt from this node and model's earlier loads (deployments/kvcalibration.py,
which the node calls after each load)."""
from __future__ import annotations

import logging

from deployments import contextfit, flagpolicy
from deployments.contextfit import Layout
from deployments.kvcalibration import correction_for, int_or_none, layout_of, memory_of, model_spec
from deployments.models import FitCalibration, ModelRepo, Node

log = logging.getLogger(__name__)
__all__ = ["deploy_context", "layout_of"]


def deploy_context(model: ModelRepo, node: Node, engine_args: dict, env: dict | None = None, *,
                   gpu_indices: list[int] | None = None, recipe=None, context: int | None = None) -> dict | None:
    """The answer the deploy page shows: for each KV dtype and DCP size (those the recipe allows, else auto and
    fp8 and every DCP the model can use at this TP), the longest context and the sequences at `context` (the
    flags' max-model-len, else the model's). None when the config or the node's memory is not known yet, or a
    flag cannot be read (the flag checks name it)."""
    try:
        layout = layout_of(engine_args)
        spec, weights = model_spec(model)
        if spec is None:
            return None
        context = context or int_or_none(engine_args.get("max-model-len")) or spec.context_length
        kv_dtypes, dcps = _recipe_choices(recipe, engine_args, spec, layout)
        kwargs = memory_of(node, env or {}, gpu_indices, engine_args)
        if kwargs is None:
            return None
        correction = correction_for(node, model)
        rows = contextfit.context_table(spec, weights, kv_dtypes=kv_dtypes, dcps=dcps, layout=layout, context=context,
                                        correction_bytes=correction, config=model.config, **kwargs)
    except (ValueError, TypeError, KeyError, flagpolicy.OptionError) as exc:
        log.debug("no context estimate for %s on %s: %s", model, node, exc)
        return None
    chosen = (flagpolicy.kv_cache_dtype(engine_args), layout.dcp)
    return {"rows": [dict(r.as_dict(), chosen=(r.kv_dtype, r.layout.dcp) == chosen) for r in rows],
            "context": context, "layout": layout.describe(), "correction_bytes": correction,
            "calibrated": FitCalibration.objects.filter(node=node, model=model).count(),
            "approximate": spec.approximate or ""}


def _recipe_choices(recipe, engine_args: dict, spec, layout: Layout) -> tuple[list[str], list[int]]:
    """KV dtypes and DCP sizes to show: the recipe's (model.kv_cache_dtypes, model.supports_dcp) when one
    is chosen, plus the deploy's own choice so it is always a row."""
    data = getattr(recipe, "data", recipe) or {}
    section = data.get("model") if isinstance(data.get("model"), dict) else {}
    allowed = section.get("kv_cache_dtypes") or section.get("allowed_kv_cache_dtypes")  # the shipped recipes' key
    kv_dtypes = [str(k) for k in allowed or contextfit.DEFAULT_KV_DTYPES]
    chosen = flagpolicy.kv_cache_dtype(engine_args)
    if chosen not in kv_dtypes:
        kv_dtypes.append(chosen)
    dcps = contextfit.dcp_sizes(spec, layout.tp)
    if recipe is not None and section.get("supports_dcp") is False:
        dcps = sorted({1, layout.dcp})
    return kv_dtypes, dcps
