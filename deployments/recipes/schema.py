"""One recipe or strategy file in vllm-project/recipes' YAML layout, read and checked.

A malformed file raises RecipeError naming the file and the field (`variants.default.vram_minimum_gb`), so a
typo in a checkout is found at import, never at a deploy. Keys the panel does not use (meta, guide, pd_cluster
pools, ...) are kept as they are and not checked: the upstream schema grows, and an unknown key is not an error.

Panel extensions, all optional and ignored by upstream's site: `reason:` beside an override's args (upstream
writes the reason as a YAML comment, which a parser cannot keep), hardware keys by compute capability
(`sm120`, more specific than `hopper` / `blackwell`), `model.kv_cache_dtypes` (those the fit may choose), and
`known_failures:` (combinations that fail, each with its reason and fix; see compat.py).
"""
import re
from dataclasses import dataclass, field

import yaml

from deployments import flagpolicy

VERSION = re.compile(r"^\d+(\.\d+){0,3}([a-z0-9.+-]*)$")
FAILURE_KEYS = ("strategy", "variant", "hardware", "tensor_parallel_size", "kv_cache_dtype", "attention_backend",
                "expert_parallel")


class RecipeError(ValueError):
    """A recipe or strategy file is not acceptable: `file` and `field` say where."""

    def __init__(self, file: str, where: str, message: str):
        super().__init__(f"{file}: {where}: {message}" if where else f"{file}: {message}")
        self.file, self.field, self.message = file, where, message


@dataclass(frozen=True)
class Layer:
    """Args and environment one part of a recipe adds (its base, a feature, a variant, an override), and why."""

    args: tuple = ()
    env: dict = field(default_factory=dict)
    reason: str = ""
    tp: int | None = None
    reasons: dict = field(default_factory=dict)  # "--flag" or "VARIABLE" -> why (a panel extension)

    def why(self, name: str) -> str:
        """The reason for one flag (canonical name) or variable: its own, else the layer's."""
        return self.reasons.get(f"--{name}") or self.reasons.get(name) or self.reason


@dataclass(frozen=True)
class Variant:
    name: str
    precision: str
    vram_minimum_gb: float | None
    layer: Layer
    model_id: str = ""
    supported_hardware: tuple = ()
    hardware_overrides: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    """A combination the recipe says fails: `when` (FAILURE_KEYS) all match, then `reason` and `fix`."""

    when: dict
    reason: str
    fix: str


@dataclass(frozen=True)
class Recipe:
    model_id: str
    title: str
    min_vllm_version: str
    architecture: str
    base: Layer
    features: dict  # name -> Layer (its description as the reason)
    opt_in_features: tuple
    variants: dict  # name -> Variant
    strategies: tuple
    hardware_overrides: dict  # hardware key -> Layer
    strategy_overrides: dict  # strategy name -> Layer
    failures: tuple = ()
    context_length: int | None = None
    supports_dcp: bool = False
    kv_cache_dtypes: tuple = ()
    verified: tuple = ()

    def model_ids(self) -> set[str]:
        """The Hugging Face repos this recipe serves (its own and its variants'), lower-case."""
        return {self.model_id.lower(), *(v.model_id.lower() for v in self.variants.values() if v.model_id)}


@dataclass(frozen=True)
class Strategy:
    name: str
    display_name: str
    deploy_type: str
    min_gpus: int
    max_gpus: int | None
    multi_node: bool
    architecture: str
    parallel_flag: str
    layer: Layer


def load_text(text: str, file: str) -> dict:
    """YAML text -> a mapping, JSON-safe (dates as text), or RecipeError."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else ""
        raise RecipeError(file, where, f"not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, dict):
        raise RecipeError(file, "", "expected a mapping at the top (a recipe or strategy file)")
    return _plain(data)


def _plain(value):
    """Dates and other YAML scalars as text, so the mapping can be stored as JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class _Reader:
    """Typed reads of one file's fields, each error naming the file and the dotted field."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, where: str, message: str):
        raise RecipeError(self.file, where, message)

    def get(self, data: dict, key: str, kind, where: str, default=None, required=False):
        if key not in data or data[key] is None:
            if required:
                self.fail(where, "is required")
            return default
        value = data[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            names = {str: "text", int: "a whole number", float: "a number", bool: "true or false", list: "a list",
                     dict: "a mapping"}
            self.fail(where, f"expected {names.get(kind, kind.__name__)}, got {_show(value)}")
        return value

    def args(self, data: dict, key: str, where: str) -> tuple:
        words = self.get(data, key, list, where, default=[])
        for i, word in enumerate(words):
            if not isinstance(word, (str, int, float)) or isinstance(word, bool):
                self.fail(f"{where}[{i}]", f"expected a flag or its value as text, got {_show(word)}")
        words = [str(w) for w in words]
        if words and not words[0].startswith("-"):
            self.fail(f"{where}[0]", f"expected a --flag first, got {_show(words[0])}")
        return tuple(words)

    def env(self, data: dict, key: str, where: str) -> dict:
        env = self.get(data, key, dict, where, default={})
        out = {}
        for name, value in env.items():
            if not flagpolicy.ENV_NAME.match(str(name)):
                self.fail(f"{where}.{name}", "is not a variable name (A-Z, 0-9, _)")
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                self.fail(f"{where}.{name}", f"expected text, got {_show(value)}")
            out[str(name)] = str(value)
        return out

    def layer(self, data, where: str, args_key="extra_args", env_key="extra_env", reason="") -> Layer:
        if not isinstance(data, dict):
            self.fail(where, f"expected a mapping, got {_show(data)}")
        at = f"{where}." if where else ""
        args = self.args(data, args_key, at + args_key)
        if args_key != "vllm_args" and "vllm_args" in data:  # strategy_overrides may use either spelling
            args += self.args(data, "vllm_args", at + "vllm_args")
        env = self.env(data, env_key, at + env_key)
        if env_key != "env" and "env" in data:
            env = {**env, **self.env(data, "env", at + "env")}
        tp = self.get(data, "tp", int, at + "tp")
        if tp is not None and tp < 1:
            self.fail(at + "tp", "a whole number from 1 up")
        reasons = self.get(data, "reasons", dict, at + "reasons", default={})
        for name, why in reasons.items():
            if not isinstance(why, str):
                self.fail(f"{at}reasons.{name}", f"expected text, got {_show(why)}")
        return Layer(args, env, self.get(data, "reason", str, at + "reason", default=reason), tp, reasons)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_recipe(data: dict, file: str) -> Recipe:
    """A model recipe (models/<org>/<model>.yaml) from its mapping, or RecipeError."""
    r = _Reader(file)
    model = r.get(data, "model", dict, "model", required=True)
    model_id = r.get(model, "model_id", str, "model.model_id", required=True)
    if not re.match(r"^[\w.-]+/[\w.-]+$", model_id):
        r.fail("model.model_id", f"expected <org>/<model>, got {_show(model_id)}")
    expected = re.search(r"models/([^/]+/[^/]+)\.ya?ml$", file.replace("\\", "/"))
    if expected and expected.group(1).lower() != model_id.lower():
        r.fail("model.model_id", f"{model_id} does not match the file's path models/{expected.group(1)}.yaml")
    version = str(r.get(model, "min_vllm_version", (str, int, float), "model.min_vllm_version", default=""))
    if version and not VERSION.match(version):
        r.fail("model.min_vllm_version", f"expected a version such as 0.19.1, got {_show(version)}")
    features = {}
    for name, spec in r.get(data, "features", dict, "features", default={}).items():
        if not isinstance(spec, dict):
            r.fail(f"features.{name}", f"expected a mapping with description and args, got {_show(spec)}")
        features[name] = Layer(r.args(spec, "args", f"features.{name}.args"),
                               r.env(spec, "env", f"features.{name}.env"),
                               r.get(spec, "description", str, f"features.{name}.description", default=name))
    opt_in = tuple(r.get(data, "opt_in_features", list, "opt_in_features", default=[]))
    for name in opt_in:
        if name not in features:
            r.fail("opt_in_features", f"{_show(name)} is not one of features ({', '.join(features) or 'none'})")
    variants_data = r.get(data, "variants", dict, "variants", required=True)
    if "default" not in variants_data:
        r.fail("variants", "a `default` variant is required")
    variants = {name: _variant(r, name, spec) for name, spec in variants_data.items()}
    strategies = r.get(data, "compatible_strategies", list, "compatible_strategies", required=True)
    for i, name in enumerate(strategies):
        if not isinstance(name, str) or not re.match(r"^[a-z0-9_]+$", name):
            r.fail(f"compatible_strategies[{i}]", f"expected a strategy name such as single_node_tp, got {_show(name)}")
    hardware = {key: r.layer(spec, f"hardware_overrides.{key}")
                for key, spec in r.get(data, "hardware_overrides", dict, "hardware_overrides", default={}).items()}
    overrides = {}
    for name, spec in r.get(data, "strategy_overrides", dict, "strategy_overrides", default={}).items():
        if name not in strategies:
            r.fail(f"strategy_overrides.{name}", f"is not in compatible_strategies ({', '.join(strategies)})")
        overrides[name] = r.layer(spec, f"strategy_overrides.{name}")
    kv = tuple(str(k) for k in r.get(model, "kv_cache_dtypes", list, "model.kv_cache_dtypes", default=[]))
    verified = r.get(data.get("meta") or {}, "hardware", dict, "meta.hardware", default={})
    return Recipe(
        model_id=model_id, title=str((data.get("meta") or {}).get("title") or model_id), min_vllm_version=version,
        architecture=r.get(model, "architecture", str, "model.architecture", default="dense"),
        base=Layer(r.args(model, "base_args", "model.base_args"), r.env(model, "base_env", "model.base_env"),
                   "the recipe's base command for this model",
                   reasons=r.get(model, "reasons", dict, "model.reasons", default={})),
        features=features, opt_in_features=opt_in, variants=variants, strategies=tuple(strategies),
        hardware_overrides=hardware, strategy_overrides=overrides, failures=_failures(r, data, strategies),
        context_length=r.get(model, "context_length", int, "model.context_length"),
        supports_dcp=bool(r.get(model, "supports_dcp", bool, "model.supports_dcp", default=False)),
        kv_cache_dtypes=kv, verified=tuple(k for k, v in verified.items() if v == "verified"))


def _variant(r: _Reader, name: str, spec) -> Variant:
    where = f"variants.{name}"
    if not isinstance(spec, dict):
        r.fail(where, f"expected a mapping, got {_show(spec)}")
    vram = r.get(spec, "vram_minimum_gb", float, f"{where}.vram_minimum_gb")
    if vram is not None and vram <= 0:
        r.fail(f"{where}.vram_minimum_gb", f"expected a size in GB above 0, got {_show(vram)}")
    layer = r.layer(spec, where, reason=r.get(spec, "description", str, f"{where}.description", default=f"variant {name}"))
    hardware = {key: r.layer(s, f"{where}.hardware_overrides.{key}")
                for key, s in r.get(spec, "hardware_overrides", dict, f"{where}.hardware_overrides", default={}).items()}
    return Variant(name, str(r.get(spec, "precision", str, f"{where}.precision", default="")), vram, layer,
                   r.get(spec, "model_id", str, f"{where}.model_id", default=""),
                   tuple(r.get(spec, "supported_hardware", list, f"{where}.supported_hardware", default=[])), hardware)


def _failures(r: _Reader, data: dict, strategies) -> tuple:
    out = []
    for i, spec in enumerate(r.get(data, "known_failures", list, "known_failures", default=[])):
        where = f"known_failures[{i}]"
        if not isinstance(spec, dict):
            r.fail(where, f"expected a mapping with when, reason and fix, got {_show(spec)}")
        when = r.get(spec, "when", dict, f"{where}.when", required=True)
        for key in when:
            if key not in FAILURE_KEYS:
                r.fail(f"{where}.when.{key}", f"is not one of {', '.join(FAILURE_KEYS)}")
        out.append(Failure(when, r.get(spec, "reason", str, f"{where}.reason", required=True),
                           r.get(spec, "fix", str, f"{where}.fix", required=True)))
    return tuple(out)


def parse_strategy(data: dict, file: str) -> Strategy:
    """A strategy (strategies/<name>.yaml) from its mapping, or RecipeError."""
    r = _Reader(file)
    name = r.get(data, "name", str, "name", required=True)
    stem = re.search(r"([^/\\]+)\.ya?ml$", file)
    if stem and stem.group(1) != name:
        r.fail("name", f"{name} does not match the file name {stem.group(0)}")
    match = r.get(data, "hardware_match", dict, "hardware_match", default={})
    min_gpus = r.get(match, "min_gpus", int, "hardware_match.min_gpus", default=1)
    max_gpus = r.get(match, "max_gpus", int, "hardware_match.max_gpus")
    if min_gpus < 1 or (max_gpus is not None and max_gpus < min_gpus):
        r.fail("hardware_match", f"min_gpus {min_gpus} and max_gpus {max_gpus} make an empty range")
    flag = r.get(data, "parallel_flag", str, "parallel_flag", default="")
    if flag:
        try:
            flagpolicy.flag_name(flag)
        except flagpolicy.OptionError as exc:
            r.fail("parallel_flag", str(exc))
    return Strategy(name, r.get(data, "display_name", str, "display_name", default=name),
                    r.get(data, "deploy_type", str, "deploy_type", default="single_node"), min_gpus, max_gpus,
                    r.get(match, "multi_node", bool, "hardware_match.multi_node", default=False),
                    r.get(match, "architecture", str, "hardware_match.architecture", default=""), flag,
                    r.layer(data, "", args_key="vllm_args", env_key="env",
                            reason=" ".join(str(data.get("description") or name).split())))


def kind_of(path: str) -> str | None:
    """'model' for models/<org>/<model>.yaml, 'strategy' for strategies/<name>.yaml, None for other files."""
    path = path.replace("\\", "/")
    if re.search(r"(^|/)models/[^/]+/[^/]+\.ya?ml$", path):
        return "model"
    if re.search(r"(^|/)strategies/[^/]+\.ya?ml$", path):
        return "strategy"
    return None


def parse(path: str, text: str):
    """(kind, name, mapping, parsed) for one file's text, or RecipeError."""
    kind = kind_of(path)
    if kind is None:
        raise RecipeError(path, "", "not a recipe file: expected models/<org>/<model>.yaml or strategies/<name>.yaml")
    data = load_text(text, path)
    if kind == "model":
        recipe = parse_recipe(data, path)
        return kind, recipe.model_id, data, recipe
    strategy = parse_strategy(data, path)
    return kind, strategy.name, data, strategy
