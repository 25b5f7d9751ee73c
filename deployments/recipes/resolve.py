"""A recipe, one of its variants and one of its strategies, for one node's GPUs: the engine flags and
environment, each with the reason the recipe gives for it.

The order is upstream's command builder's: the model's base args, its features (those not opt-in), the
variant's args, the strategy's args and its parallel size, the hardware family's overrides, then the
strategy's overrides; a later layer wins for the same flag. What the panel cannot take as given (a flag it
sets itself, a `$PLACEHOLDER` value, a variable outside its allowlist) is left out and said so, never
passed on silently.
"""
from dataclasses import dataclass, field

from deployments import flagpolicy, privileged, userflags
from deployments.host import serveargv
from deployments.recipes.schema import Layer, Recipe, Strategy

# vLLM's datacenter Blackwell kernels (CUTLASS_MLA, FLASHINFER_MLA) check capability major == 10, so a
# `blackwell` block is not applied to SM120 (RTX PRO 6000): only `sm120` and the brand-wide `nvidia` are.
FAMILIES = {8: "ampere", 9: "hopper", 10: "blackwell", 11: "blackwell"}


@dataclass(frozen=True)
class Target:
    """What a deploy offers a recipe: GPUs per node, their compute capability ("" without GPUs), the smallest
    GPU's memory in bytes, and the node count."""

    gpus: int
    capability: str = ""
    gpu_memory: int = 0
    nnodes: int = 1

    @classmethod
    def of_node(cls, node, gpu_indices=None, nnodes: int = 1) -> "Target":
        gpus = [g for g in node.gpus.all() if gpu_indices is None or g.index in gpu_indices]
        return cls(len(gpus), min((g.compute_capability for g in gpus if g.compute_capability), default=""),
                   min((g.memory_total for g in gpus), default=0), nnodes)


@dataclass(frozen=True)
class Reason:
    """One flag or variable and why: the recipe's reason (`why`, `source`) and what the option does (`what`)."""

    name: str
    value: object
    why: str
    source: str
    what: str = ""


@dataclass
class Resolved:
    recipe: Recipe
    variant: str
    strategy: str
    hardware: str  # the hardware_overrides key applied, or ""
    flags: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)  # flag -> Reason
    env_reasons: dict = field(default_factory=dict)  # variable -> Reason
    gpus: int = 0  # GPUs per node the layout uses
    left_out: list = field(default_factory=list)  # what the panel did not take, and why

    def label(self) -> str:
        return f"{self.recipe.model_id} · {self.variant} · {self.strategy}" + (f" · {self.hardware}" if self.hardware else "")


class ResolveError(ValueError):
    """The choice does not exist or does not apply to these GPUs; the message says which and why."""


def hardware_keys(capability: str) -> list[str]:
    """'12.0' -> ['sm120', 'nvidia']; '9.0' -> ['sm90', 'hopper', 'nvidia']; '' -> ['cpu']: most specific first."""
    if not capability:
        return ["cpu"]
    major, _, minor = capability.partition(".")
    if not major.isdigit():
        return ["nvidia"]
    keys = [f"sm{major}{minor or '0'}"]
    if family := FAMILIES.get(int(major)):
        keys.append(family)
    return keys + ["nvidia"]


def hardware_key(overrides: dict, capability: str) -> str:
    """The one hardware_overrides key that applies (upstream: a family's block, else `nvidia`), or ""."""
    return next((k for k in hardware_keys(capability) if k in overrides), "")


def strategy_problem(strategy: Strategy, recipe: Recipe, target: Target) -> str:
    """Why this strategy does not apply to these GPUs, or ""."""
    total = max(target.gpus, 1) * target.nnodes
    if strategy.deploy_type not in ("single_node", "multi_node"):
        return f"{strategy.display_name} ({strategy.deploy_type}) is not something the panel deploys"
    if strategy.multi_node != (target.nnodes > 1):
        return (f"{strategy.display_name} needs several nodes" if strategy.multi_node
                else f"{strategy.display_name} runs on one node")
    if strategy.architecture and strategy.architecture != recipe.architecture:
        return f"{strategy.display_name} is for {strategy.architecture} models; {recipe.model_id} is {recipe.architecture}"
    if target.gpus and total < strategy.min_gpus:
        return f"{strategy.display_name} needs at least {strategy.min_gpus} GPUs; {total} offered"
    if not target.gpus and strategy.min_gpus > 1:
        return f"{strategy.display_name} needs GPUs"
    return ""


def strategies_for(recipe: Recipe, strategies: dict, target: Target) -> list[str]:
    """The recipe's strategies, in its order, that are loaded and apply to these GPUs."""
    return [n for n in recipe.strategies if n in strategies and not strategy_problem(strategies[n], recipe, target)]


def resolve(recipe: Recipe, strategies: dict, variant: str, strategy: str, target: Target,
            features: list[str] | None = None) -> Resolved:
    """The flags and environment for this choice on `target` (see the module's docstring), or ResolveError."""
    if variant not in recipe.variants:
        raise ResolveError(f"{recipe.model_id} has no variant {variant!r} ({', '.join(recipe.variants)})")
    if strategy not in recipe.strategies:
        raise ResolveError(f"{recipe.model_id} does not list strategy {strategy!r} ({', '.join(recipe.strategies)})")
    if strategy not in strategies:
        raise ResolveError(f"strategy {strategy!r} is not loaded: import strategies/{strategy}.yaml with the recipes")
    plan = strategies[strategy]
    if problem := strategy_problem(plan, recipe, target):
        raise ResolveError(problem)
    chosen = recipe.variants[variant]
    key = hardware_key(recipe.hardware_overrides, target.capability)
    own_key = hardware_key(chosen.hardware_overrides, target.capability)
    out = Resolved(recipe, variant, strategy, key or own_key)
    on = [n for n in recipe.features if n not in recipe.opt_in_features] if features is None else features
    layers = [("base", recipe.base)]
    layers += [(f"feature {n}", recipe.features[n]) for n in on if n in recipe.features]
    layers += [(f"variant {variant}", chosen.layer), (f"strategy {strategy}", plan.layer)]
    if key:
        layers.append((f"hardware {key}", recipe.hardware_overrides[key]))
    if own_key:
        layers.append((f"variant {variant} on {own_key}", chosen.hardware_overrides[own_key]))
    override = recipe.strategy_overrides.get(strategy)
    if override:
        layers.append((f"strategy override {strategy}", override))
    for source, layer in layers:
        _apply(out, layer, source)
    pin = ((override.tp, override.reason or "pinned by the recipe", f"strategy override {strategy}")
           if override and override.tp else
           (chosen.layer.tp, chosen.layer.reason, f"variant {variant}") if chosen.layer.tp else None)
    _parallel(out, plan, target, pin)
    return out


def _apply(out: Resolved, layer: Layer, source: str) -> None:
    for name, value, problem in _pairs(layer.args):
        if problem:
            out.left_out.append(f"{source}: {name}: {problem}")
            continue
        if f"--{name}" in serveargv.RESERVED_FLAGS:
            out.left_out.append(f"{source}: --{name} is {serveargv.RESERVED_FLAGS[f'--{name}']}")
            continue
        out.flags[name] = value
        out.reasons[name] = Reason(name, value, layer.why(name), source, what_flag(name))
    for name, value in layer.env.items():
        if value.startswith("$"):
            out.left_out.append(f"{source}: {name}={value} names a value of this host (set it under Environment)")
            continue
        if refused := userflags.check_env({name: value}):
            out.left_out.append(f"{source}: {refused['env']}")
            continue
        out.env[name] = value
        out.env_reasons[name] = Reason(name, value, layer.why(name), source, privileged.ENV.get(name, ""))


def _parallel(out: Resolved, plan: Strategy, target: Target, pin: tuple[int, str, str] | None) -> None:
    """The strategy's parallel flag sized to the GPUs: TP over all of them, DP with one TP group per replica,
    or TP per node and PP over the nodes; a TP the variant or a strategy override pins wins, with its reason."""
    if not target.gpus:  # the CPU engine: one process, no parallel flags
        return
    total = target.gpus * target.nnodes
    flag = flagpolicy.flag_name(plan.parallel_flag) if plan.parallel_flag else "tensor-parallel-size"
    source = f"strategy {plan.name}"
    sized = f"{plan.display_name}: sized to the {total} GPUs offered"
    tp = pin[0] if pin else (total if flag == "tensor-parallel-size" else
                             target.gpus if flag == "pipeline-parallel-size" else 1)
    if pin or flag == "tensor-parallel-size":
        _set(out, "tensor-parallel-size", tp, pin[1] if pin else sized, pin[2] if pin else source)
    if flag == "data-parallel-size" and total // tp > 1:
        _set(out, "data-parallel-size", total // tp, sized, source)
    if flag == "pipeline-parallel-size" and target.nnodes > 1:
        _set(out, "pipeline-parallel-size", target.nnodes, f"{plan.display_name}: one stage per node", source)
    used = tp * out.flags.get("data-parallel-size", 1) * out.flags.get("pipeline-parallel-size", 1)
    out.gpus = max(1, min(target.gpus, used // target.nnodes))


def _set(out: Resolved, name: str, value, why: str, source: str) -> None:
    out.flags[name] = value
    out.reasons[name] = Reason(name, value, why, source, what_flag(name))


def _pairs(words: tuple):
    """('--a', '1', '--b', '-cc.x=1') -> (name, value, problem) per flag, canonical names, values checked."""
    i = 0
    while i < len(words):
        word, value = words[i], True
        name, sep, inline = word.partition("=")
        if sep:
            value = inline
        elif i + 1 < len(words) and not words[i + 1].startswith("-"):
            value, i = words[i + 1], i + 1
        i += 1
        try:
            canonical = flagpolicy.flag_name(name)
        except flagpolicy.OptionError as exc:
            yield word, None, f"not taken ({exc})"
            continue
        problem = flagpolicy.value_problem(value)
        yield canonical, value, (f"not taken ({problem})" if problem else "")


def what_flag(name: str) -> str:
    """What an option does, from the operator list or the admin list (empty when neither names it)."""
    if name in privileged.FLAGS:
        return f"needs an admin: {privileged.FLAGS[name]}"
    return flagpolicy.OPERATOR_FLAGS.get(name, "")
