"""How much context a deploy holds on a node, shown before Deploy, and the calibration after each load (issue 29
item 3). The arithmetic is deployments/contextfit.py; here: a node's GPUs (or RAM), the deploy's flags, the
recipe's KV dtypes and DCP sizes, and the corrections learnt from this node and model's earlier loads."""
from __future__ import annotations

import logging

from deployments import contextfit, engineoptions, modelconfig
from deployments.contextfit import EngineKv, Layout
from deployments.models import Deployment, FitCalibration, ModelRepo, Node

log = logging.getLogger(__name__)
__all__ = ["deploy_context", "deployment_estimate", "load_calibrate", "correction_for"]
RECENT_LOADS = 3  # the corrections the next estimate takes the median of


def correction_for(node: Node, model: ModelRepo) -> int:
    """The reserve correction per GPU (bytes) this node and model's recent loads imply; 0 before the first."""
    recent = FitCalibration.objects.filter(node=node, model=model).values_list("correction_bytes", flat=True)
    return contextfit.combined_correction(list(recent[:RECENT_LOADS]))


def layout_of(engine_args: dict) -> Layout:
    """The layout the flags ask for (canonical flag names, as the form and the API store them)."""
    dcp = engineoptions.count(engine_args, "decode-context-parallel-size")
    return Layout(tp=engineoptions.count(engine_args, "tensor-parallel-size"),
                  pp=engineoptions.count(engine_args, "pipeline-parallel-size"),
                  dp=engineoptions.count(engine_args, "data-parallel-size"),
                  ep=bool(engine_args.get("enable-expert-parallel")), dcp=dcp)


def deploy_context(model: ModelRepo, node: Node, engine_args: dict, env: dict | None = None, *,
                   gpu_indices: list[int] | None = None, recipe=None, context: int | None = None) -> dict | None:
    """The answer the deploy page shows: for each KV dtype and DCP size (those the recipe allows, else auto and
    fp8 and every DCP the model can use at this TP), the longest context and the sequences at `context` (the
    flags' max-model-len, else the model's). None when the config or the node's memory is not known yet, or a
    flag cannot be read (the flag checks name it)."""
    try:
        layout = layout_of(engine_args)
        spec, weights = _spec(model)
        if spec is None:
            return None
        context = context or _int(engine_args.get("max-model-len")) or spec.context_length
        kv_dtypes, dcps = _recipe_choices(recipe, engine_args, spec, layout)
        kwargs = _memory(node, env or {}, gpu_indices, engine_args)
        if kwargs is None:
            return None
        correction = correction_for(node, model)
        rows = contextfit.context_table(spec, weights, kv_dtypes=kv_dtypes, dcps=dcps, layout=layout, context=context,
                                        correction_bytes=correction, config=model.config, **kwargs)
    except (ValueError, TypeError, KeyError, engineoptions.OptionError) as exc:
        log.debug("no context estimate for %s on %s: %s", model, node, exc)
        return None
    chosen = (str(engine_args.get("kv-cache-dtype") or "auto"), layout.dcp)
    return {"rows": [dict(r.as_dict(), chosen=(r.kv_dtype, r.layout.dcp) == chosen) for r in rows],
            "context": context, "layout": layout.describe(), "correction_bytes": correction,
            "calibrated": FitCalibration.objects.filter(node=node, model=model).count(),
            "approximate": spec.approximate or ""}


def deployment_estimate(d: Deployment) -> contextfit.ContextFit | None:
    """The estimate for exactly this deployment's settings (its KV dtype and DCP), with today's correction."""
    try:
        spec, weights = _spec(d.model)
        kwargs = _memory(d.node, d.env or {}, d.gpu_indices or None, d.engine_args)
        if spec is None or kwargs is None:
            return None
        return contextfit.context_fit(spec, weights, layout=layout_of(d.engine_args),
                                      kv_dtype=str(d.engine_args.get("kv-cache-dtype") or "auto"),
                                      correction_bytes=correction_for(d.node, d.model), config=d.model.config, **kwargs)
    except (ValueError, TypeError, KeyError, engineoptions.OptionError):
        return None


def load_calibrate(d: Deployment, engine: EngineKv) -> FitCalibration | None:
    """After a load: the estimate against the engine's own KV-cache size, stored with the correction the next
    estimate for this node and model uses. Nothing when the log had no size or the size was set explicitly."""
    estimate = deployment_estimate(d)
    if estimate is None:
        return None
    found = contextfit.calibrate(estimate, engine)
    if found is None:
        return None
    layout = f"{estimate.layout.describe()}, {estimate.kv_dtype}"
    log.info("deployment %s: KV estimate %s tokens, engine %s (%+.1f %%)", d.pk, found.predicted_tokens,
             found.observed_tokens, 100 * found.error)
    return FitCalibration.objects.create(node=d.node, model=d.model, deployment=d, layout=layout[:100],
                                         predicted_tokens=found.predicted_tokens, observed_tokens=found.observed_tokens,
                                         error=found.error, correction_bytes=found.correction_bytes)


def _spec(model: ModelRepo):
    if not model.config:
        return None, 0
    files = [(f["path"], f["size"]) for f in model.files]
    return modelconfig.parse_config(model.config, files), modelconfig.weight_bytes(files) or model.total_size


def _memory(node: Node, env: dict, gpu_indices, engine_args: dict) -> dict | None:
    """The memory side of the estimate: the chosen GPUs (all by default), or for a CPU node its RAM, with the
    engine's reserve, the utilization and an explicit KV size where one is set."""
    utilization = float(engine_args.get("gpu-memory-utilization") or 0.9)
    explicit = _int(engine_args.get("kv-cache-memory-bytes"))
    gpus = sorted(node.gpus.all(), key=lambda g: g.index)
    if gpus:
        memories = [g.memory_total for g in gpus if not gpu_indices or g.index in gpu_indices]
        return {"gpu_memory_bytes": memories, "utilization": utilization, "kv_bytes_per_gpu": explicit,
                "reserve_bytes": contextfit.GPU_RESERVE_BYTES}
    if not node.ram_total:
        return None
    space = env.get("VLLM_CPU_KVCACHE_SPACE")
    if space not in (None, "", "0") and explicit is None:
        explicit = int(float(space) * 2**30)
    return {"gpu_memory_bytes": [node.ram_total], "utilization": utilization, "kv_bytes_per_gpu": explicit,
            "reserve_bytes": contextfit.CPU_RESERVE_BYTES}


def _recipe_choices(recipe, engine_args: dict, spec, layout: Layout) -> tuple[list[str], list[int]]:
    """KV dtypes and DCP sizes to show: the recipe's (model.kv_cache_dtypes, model.supports_dcp) when one
    is chosen, plus the deploy's own choice so it is always a row."""
    data = getattr(recipe, "data", recipe) or {}
    section = data.get("model") if isinstance(data.get("model"), dict) else {}
    allowed = section.get("kv_cache_dtypes") or section.get("allowed_kv_cache_dtypes")  # the shipped recipes' key
    kv_dtypes = [str(k) for k in allowed or contextfit.DEFAULT_KV_DTYPES]
    chosen = str(engine_args.get("kv-cache-dtype") or "auto")
    if chosen not in kv_dtypes:
        kv_dtypes.append(chosen)
    dcps = contextfit.dcp_sizes(spec, layout.tp)
    if recipe is not None and section.get("supports_dcp") is False:
        dcps = sorted({1, layout.dcp})
    return kv_dtypes, dcps


def _int(value) -> int | None:
    try:
        return int(value) if value not in (None, "", False) else None
    except (TypeError, ValueError):
        return None
