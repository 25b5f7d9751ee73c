"""The KV-cache estimate for one deployment's own settings and the calibration a finished load records.

Beneath both sides: the node calls `load_calibrate` when a load it followed is ready (deployments/loads.py);
the deploy page's estimate (services/contextfit.py) reads the corrections it stored. The arithmetic is
deployments/contextfit.py."""
from __future__ import annotations

import logging

from deployments import contextfit, flagpolicy, modelconfig, modelfit
from deployments.contextfit import EngineKv, Layout
from deployments.models import Deployment, FitCalibration, ModelRepo, Node

log = logging.getLogger(__name__)
__all__ = ["correction_for", "deployment_estimate", "layout_of", "load_calibrate", "memory_of", "model_spec"]
RECENT_LOADS = 3  # the corrections the next estimate takes the median of


def correction_for(node: Node, model: ModelRepo) -> int:
    """The reserve correction per GPU (bytes) this node and model's recent loads imply; 0 before the first."""
    recent = FitCalibration.objects.filter(node=node, model=model).values_list("correction_bytes", flat=True)
    return contextfit.combined_correction(list(recent[:RECENT_LOADS]))


def layout_of(engine_args: dict) -> Layout:
    """The layout the flags ask for (canonical flag names, as the form and the API store them)."""
    dcp = flagpolicy.count(engine_args, "decode-context-parallel-size")
    return Layout(tp=flagpolicy.count(engine_args, "tensor-parallel-size"),
                  pp=flagpolicy.count(engine_args, "pipeline-parallel-size"),
                  dp=flagpolicy.count(engine_args, "data-parallel-size"),
                  ep=bool(engine_args.get("enable-expert-parallel")), dcp=dcp)


def deployment_estimate(d: Deployment) -> contextfit.ContextFit | None:
    """The estimate for exactly this deployment's settings (its KV dtype and DCP), with today's correction."""
    try:
        spec, weights = model_spec(d.model)
        kwargs = memory_of(d.node, d.env or {}, d.gpu_indices or None, d.engine_args)
        if spec is None or kwargs is None:
            return None
        return contextfit.context_fit(spec, weights, layout=layout_of(d.engine_args),
                                      kv_dtype=flagpolicy.kv_cache_dtype(d.engine_args),
                                      correction_bytes=correction_for(d.node, d.model), config=d.model.config, **kwargs)
    except (ValueError, TypeError, KeyError, flagpolicy.OptionError):
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


def model_spec(model: ModelRepo):
    """The model's parsed config and its weight bytes; (None, 0) before its config is known."""
    if not model.config:
        return None, 0
    files = [(f["path"], f["size"]) for f in model.files]
    return modelconfig.parse_config(model.config, files), modelconfig.weight_bytes(files) or model.total_size


def memory_of(node: Node, env: dict, gpu_indices, engine_args: dict) -> dict | None:
    """The memory side of the estimate: the chosen GPUs (all by default), or for a CPU node its RAM, with the
    engine's reserve, the utilization and an explicit KV size where one is set."""
    utilization = flagpolicy.gpu_memory_utilization(engine_args)
    explicit = int_or_none(engine_args.get("kv-cache-memory-bytes"))
    gpus = node.gpus.all()
    if gpus:
        memories = modelfit.usable_memory(gpus, node.foreign_processes, gpu_indices or None)  # less display servers'
        return {"gpu_memory_bytes": memories, "utilization": utilization, "kv_bytes_per_gpu": explicit,
                "reserve_bytes": contextfit.GPU_RESERVE_BYTES}
    if not node.ram_total:
        return None
    space = env.get("VLLM_CPU_KVCACHE_SPACE")
    if space not in (None, "", "0") and explicit is None:
        explicit = int(float(space) * 2**30)
    return {"gpu_memory_bytes": [node.ram_total], "utilization": utilization, "kv_bytes_per_gpu": explicit,
            "reserve_bytes": contextfit.CPU_RESERVE_BYTES}


def int_or_none(value) -> int | None:
    try:
        return int(value) if value not in (None, "", False) else None
    except (TypeError, ValueError):
        return None
