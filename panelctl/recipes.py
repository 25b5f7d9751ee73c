"""panelctl recipes: list the recipes the panel knows and import a checkout of vllm-project/recipes.

    panelctl recipes import ~/src/recipes                 # models/*/*.yaml and strategies/*.yaml (admins)
    panelctl recipes import ~/src/recipes/models/moonshotai/Kimi-K2.5.yaml --source my-fixes
    panelctl recipes list [--name moonshotai/Kimi-K2.5]
    panelctl deploy moonshotai/Kimi-K2.5 --node gpu-01 --recipe moonshotai/Kimi-K2.5 --strategy single_node_tp

One malformed file refuses the whole import (exit 2), each error naming its file and field.
"""
from pathlib import Path

from panelctl.client import BAD_INPUT, CliError, emit
from plumbing import recipefiles


def cmd_import(panel, args):
    folder = Path(args.path).expanduser()
    if not folder.exists():
        raise CliError(f"{folder}: no such file or folder.", BAD_INPUT)
    try:
        files = recipefiles.read(folder)
    except (recipefiles.CheckoutError, OSError) as exc:
        raise CliError(str(exc), BAD_INPUT) from exc
    if not files:
        raise CliError(f"{folder}: no models/<org>/<model>.yaml or strategies/<name>.yaml in it.", BAD_INPUT)
    version = args.version or recipefiles.version(folder if folder.is_dir() else folder.parent)
    source = args.source or (folder if folder.is_dir() else folder.parent).resolve().name
    done = panel.post("recipes/import/", {"source": source, "version": version,
                                          "files": [{"path": p, "text": t} for p, t in files]})
    emit(done, args.json, [f"Imported {done['models']} recipe(s) and {done['strategies']} strategy file(s) as "
                           f"{done['source']}" + (f" at {version[:12]}" if version else "") + "."])
    return 0


def cmd_list(panel, args):
    rows = panel.get("recipes/", **({"name": args.name} if args.name else {}))["results"]
    lines = [f"{r['id']:>4} {r['kind']:<8} {r['name']:<40} {r['source']:<28} {r['version'][:12]:<12} "
             + (f"variants {', '.join(r['variants'])}; {', '.join(r['strategies'])}" if r["kind"] == "model" else "")
             for r in rows]
    emit(rows, args.json, lines or ["No recipes."])
    return 0


def add(sub, common) -> None:
    """The `recipes` subcommand."""
    p = sub.add_parser("recipes", help="recipes in vllm-project/recipes' layout: list, import a checkout")
    inner = p.add_subparsers(dest="recipes_command", required=True)
    s = inner.add_parser("import", parents=[common], help="import a checkout's (or one file's) recipes (admins)")
    s.add_argument("path", help="a checkout of vllm-project/recipes, or one models/<org>/<model>.yaml")
    s.add_argument("--source", default="", help="the name to import under (default: the folder's name); a second "
                   "import under the same name replaces the first")
    s.add_argument("--version", default="", help="default: the checkout's git commit")
    s.set_defaults(fn=cmd_import)
    s = inner.add_parser("list", parents=[common], help="the recipes the panel knows, with source and version")
    s.add_argument("--name", default="", help="only this model id or strategy name")
    s.set_defaults(fn=cmd_list)


def deploy_arguments(s) -> None:
    """panelctl deploy's recipe options."""
    s.add_argument("--recipe", default="", help="start from this recipe (model id or id, see `panelctl recipes list`): "
                   "its flags for the node under yours, its GPUs unless --gpus or NAME:0,1 name them")
    s.add_argument("--variant", default="", help="the recipe's variant (default: default)")
    s.add_argument("--strategy", default="", help="the recipe's strategy, e.g. single_node_tep (default: its first "
                   "that applies to the node)")
    s.add_argument("--override-compat", action="store_true", help="deploy although the compatibility check says it "
                   "would fail (admins only, recorded on the timeline); without it such a deploy is refused (exit 3)")


def deploy_body(args) -> dict:
    """The recipe fields of a deploy request."""
    return {"recipe": args.recipe, "variant": args.variant, "strategy": args.strategy,
            "override_compat": args.override_compat}
