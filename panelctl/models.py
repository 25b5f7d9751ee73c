"""panelctl models, model-add, model-remove: the Hugging Face repos the panel holds."""
from panelctl.client import NOT_FOUND, CliError, Panel, emit, say


def model_id(panel: Panel, ref: str) -> int:
    """A model's id from its id or repo id."""
    if ref.isdigit():
        return int(ref)
    found = panel.get("models/", repo_id=ref)["results"]
    if not found:
        raise CliError(f"No model {ref!r} in the panel: add it first (panelctl model-add {ref}), then deploy it.", NOT_FOUND)
    return found[0]["id"]


def cmd_models(panel, args):
    models = panel.get("models/")["results"]
    emit(models, args.json, [f"{m['id']:>4} {m['repo_id']:<40} {m['architecture'] or '?':<28} {m['total_size'] / 2**30:,.1f} GiB"
                             for m in models])
    return 0


def cmd_model_add(panel, args):
    model = panel.post("models/", {"repo_id": args.repo_id, "revision": args.revision}, key=args.idempotency_key)
    emit(model, args.json, [f"Added {model['repo_id']} (id {model['id']}); it is being inspected."])
    return 0


def cmd_model_remove(panel, args):
    """Forget a model the panel holds no copy or deployment of (a repo added by mistake)."""
    panel.call("DELETE", f"models/{model_id(panel, args.model)}/")
    say(f"Removed {args.model}.")
    return 0


def add(sub) -> None:
    """The `models`, `model-add` and `model-remove` subcommands (sub: with the common options)."""
    sub.add_parser("models", help="models in the panel").set_defaults(fn=cmd_models)
    s = sub.add_parser("model-add", help="add a Hugging Face repo")
    s.add_argument("repo_id")
    s.add_argument("--revision", default="main")
    s.set_defaults(fn=cmd_model_add)
    s = sub.add_parser("model-remove", help="forget a model without copies or deployments (id or repo id)")
    s.add_argument("model")
    s.set_defaults(fn=cmd_model_remove)
