"""Whether a model fits a node (its GPUs, or its RAM for the CPU engine), and the fit verdict gating a deploy:
the estimate the deploy page shows for the deploy's own settings, and the refusal of what it
says will not fit unless an admin overrides it."""
from deployments import flagpolicy, modelconfig, modelfit, userflags
from deployments.models import Deployment, ModelRepo, Node
from deployments.services.gateoverride import GateOverride, gate_override
from plumbing.errors import ServiceError

__all__ = ["model_fit", "deploy_fit", "model_fit_gate", "OVERRIDE_HINT"]
OVERRIDE_HINT = ("an admin can deploy it anyway (the form's \"Deploy anyway\", API: override_fit, "
                 "panelctl: --override-fit)")


def model_fit(model: ModelRepo, node: Node, tp: int, pp: int = 1, gpu_memory_utilization: float = flagpolicy.GPU_MEMORY_UTILIZATION,
              kv_cache_dtype: str = "auto", gpu_indices: list[int] | None = None, context_length: int | None = None,
              kv_cache_gib: float | None = None) -> modelfit.FitResult | modelfit.CpuFitResult | None:
    """Does the model fit the node's GPUs (those chosen, else all) at TP×PP (a node without GPUs: its RAM and
    cores, for the CPU engine with `kv_cache_gib` of KV cache, the CPU preset's by default)? None when the
    config (GPUs) or the size (CPU) is not known yet."""
    files = [(f["path"], f["size"]) for f in model.files]
    if not node.gpus.all():
        weights = modelconfig.weight_bytes(files) or model.total_size
        if not weights:
            return None
        if kv_cache_gib is None:
            kv_cache_gib = float(userflags.PRESETS[userflags.node_preset(False)]["env"]["VLLM_CPU_KVCACHE_SPACE"])
        return modelfit.cpu_fit_check(weights, node.ram_total, node.cpu_count, int(kv_cache_gib * 2**30))
    if not model.config:
        return None
    spec = modelconfig.parse_config(model.config, files)
    memories = modelfit.usable_memory(node.gpus.all(), node.foreign_processes, gpu_indices)
    return modelfit.fit_check(spec, modelconfig.weight_bytes(files) or model.total_size, memories, tp, pp,
                              gpu_memory_utilization=gpu_memory_utilization, kv_cache_dtype=kv_cache_dtype,
                              context_length=context_length)


def deploy_fit(model: ModelRepo, node: Node, gpu_indices: list[int], engine_args: dict, env: dict):
    """The fit estimate for these settings on this node (None: unknown yet): the chosen GPUs at the flags'
    TP × PP, utilization, KV-cache dtype and max-model-len; on a node without GPUs, its RAM for the weights,
    the engine's VLLM_CPU_KVCACHE_SPACE and its processes."""
    kv_gib = env.get("VLLM_CPU_KVCACHE_SPACE")
    try:
        return model_fit(
            model, node, flagpolicy.count(engine_args, "tensor-parallel-size"),
            flagpolicy.count(engine_args, "pipeline-parallel-size"),
            flagpolicy.gpu_memory_utilization(engine_args), flagpolicy.kv_cache_dtype(engine_args),
            gpu_indices=gpu_indices or None, context_length=_int(engine_args.get("max-model-len")),
            kv_cache_gib=float(kv_gib) if kv_gib not in (None, "") else None)
    except (ValueError, TypeError, KeyError, flagpolicy.OptionError):
        return None  # a value the estimate cannot read (the flag checks name it): no verdict


def _int(value) -> int | None:
    try:
        return int(value) if value not in (None, "", False) else None
    except (TypeError, ValueError):
        return None


def model_fit_gate(model: ModelRepo, node: Node, gpu_indices: list[int], engine_args: dict, env: dict, *,
                   nnodes: int = 1, override: bool = False, admin: bool = False,
                   deployment: Deployment | None = None) -> GateOverride | None:
    """Refuse a deploy its fit estimate says will not fit (409 does_not_fit, naming the reason), unless an
    admin overrides it: then the override to record on the timeline. An unknown verdict (config not read,
    RAM not reported) and a deploy over several nodes (each node's share is checked by the plan) pass.
    A redeploy of a deployment an admin already overrode with this same verdict keeps that override."""
    if nnodes > 1:
        return None
    fit = deploy_fit(model, node, gpu_indices, engine_args, env)
    if fit is None or fit.fits or not getattr(fit, "known", True):
        return None
    verdict = fit.message
    refusal = ServiceError(f"{model} does not fit {node}: {verdict.removeprefix('does not fit: ')}. "
                           f"{_remedy(fit)}; {OVERRIDE_HINT}.", field="model", code="does_not_fit")
    return gate_override(refusal, check="the fit check", step="fit_override", verdict=verdict, says=f" {verdict}",
                         data={"verdict": verdict}, override=override, admin=admin, deployment=deployment,
                         override_field="override_fit")


def _remedy(fit) -> str:
    """What the user can change to make it fit."""
    if isinstance(fit, modelfit.CpuFitResult):
        return "Choose a smaller model, a node with more RAM, or a smaller VLLM_CPU_KVCACHE_SPACE"
    if fit.kv_tokens and fit.kv_tokens < fit.context_length:
        return f"Set a max model length of at most {fit.kv_tokens:,}, or use more GPUs or an fp8 KV cache"
    return "Use more GPUs (a larger tensor or pipeline parallel size), or a smaller or quantized model"
