"""What a deploy gets for what its caller leaves out, the same from the form, the API and panelctl
("the CLI is the form"): the deploy form's own values for the node, computed by the form itself
so that no copy of its defaults can drift, and the served model name clients call it by."""
from deployments import callit, userflags
from plumbing.errors import ServiceError


def preset_initial(key: str) -> dict:
    """The deploy form's initial values for a preset (field name -> value)."""
    preset = dict(userflags.PRESETS[key])
    initial = {k: v for k, v in preset.items() if k not in ("label", "flags", "env")}
    initial["extra_flags"] = " ".join(userflags.argv_words(preset.get("flags", {})))
    initial["env"] = "\n".join(f"{k}={v}" for k, v in preset.get("env", {}).items())
    return initial


def preset_key(node, key: str = "auto") -> str:
    """`auto`: the preset that works on the node as it is (one GPU, or the CPU engine's)."""
    return userflags.node_preset(node.gpus.exists()) if key == "auto" else key


def flags_initial(flags: dict, env: dict) -> dict:
    """The deploy form's initial values for these flags and environment (a recipe's): each flag in its own
    field where that field can hold the value, the others as extra flags."""
    from django import forms

    from deployments.forms import DeployForm

    initial, extra = {}, {}
    for name, value in flags.items():
        field = DeployForm.base_fields.get(userflags.FLAG_FIELDS.get(name, ""))
        if isinstance(field, forms.ChoiceField):
            fits = str(value) in {str(k) for k, _ in field.choices}
        else:
            fits = field is not None and (value is True or not isinstance(field, forms.BooleanField))
        if fits:
            initial[userflags.FLAG_FIELDS[name]] = value
        elif name != "enable-auto-tool-choice" or not flags.get("tool-call-parser"):  # the parser's field sets it
            extra[name] = value
    initial["extra_flags"] = " ".join(userflags.argv_words(extra))
    initial["env"] = "\n".join(f"{k}={v}" for k, v in env.items())
    return initial


def form_defaults(node, key: str = "auto", initial: dict | None = None) -> tuple[dict, dict]:
    """The engine flags and environment the deploy form sends for `node` when nothing is changed on it
    (its preset, or the `initial` values a recipe filled in, and its fields' own defaults, e.g.
    --gpu-memory-utilization 0.9): the form submitted with its initial values. A preset the node's engine
    refuses falls back to the preset alone; a recipe it refuses is refused, naming the field."""
    from deployments.forms import DeployForm

    key = preset_key(node, key)
    unbound = DeployForm(node=node, initial=preset_initial(key) if initial is None else initial)
    data = submitted(unbound, keep=())
    needed = int(data.get("tp") or 1) * int(data.get("pp") or 1) * int(data.get("dp") or 1)
    data["gpus"] = [str(g.index) for g in node.gpus.all()][:needed]
    data["port"] = 1024  # any valid port: the caller's or a free one is used, never this
    form = DeployForm(data=data, node=node)
    if form.is_valid():
        return form.cleaned_data["engine_args"], form.cleaned_data["env_vars"]
    if initial is not None:
        field, errors = next(iter(form.errors.items()))
        raise ServiceError(f"The recipe does not fit the deploy form on {node}: {field}: {' '.join(errors)}",
                           field="recipe")
    return userflags.with_preset(key, {}, {})


def submitted(unbound, keep=("gpus", "port")) -> dict:
    """What an unbound form sends when submitted as shown (its initial values), `keep` of the fields
    gpus, replace, workers and port included."""
    data = {}
    for name in unbound.fields:
        value = unbound[name].value()
        if value in (None, False, "", []) or (name in ("gpus", "replace", "workers", "port") and name not in keep):
            continue
        data[name] = [str(v) for v in value] if isinstance(value, (list, tuple)) else value
    return data


def with_defaults(node, model, engine_args: dict, env: dict, key: str = "", base: tuple | None = None) -> tuple[dict, dict]:
    """The caller's flags and environment over the form's defaults (`key`: a preset, "auto", or "" for
    none; `base`: a recipe's form defaults, used instead of a preset), with --served-model-name the repo id
    unless the caller named it."""
    if key:
        flags, variables = base or form_defaults(node, key)
        engine_args, env = {**flags, **engine_args}, {**variables, **env}
    knows = not node.engine_flags or "--served-model-name" in node.engine_flags  # every vLLM does; a stand-in may not
    if knows and not str(engine_args.get("served-model-name") or "").strip():
        engine_args = {**engine_args, "served-model-name": callit.served_name(model)}
    return engine_args, env


def keep_served_name(engine_args: dict, old_args: dict) -> dict:
    """A redeploy's new flags keep the name clients call it by when they do not name one, so
    a changed setting does not turn the name into a path; flags stored without a name stay without."""
    name = old_args.get("served-model-name")
    if name and "served-model-name" not in engine_args:
        return {**engine_args, "served-model-name": name}
    return engine_args
