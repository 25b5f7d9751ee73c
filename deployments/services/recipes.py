"""Recipes in the database: the recipes folder (RECIPES_DIR, else the shipped deployments/recipes/data/) read
again whenever its files change, imports from a checkout of vllm-project/recipes, and the recipes that match
a model and a node's GPUs, resolved to flags (deployments/recipes/resolve.py)."""
import hashlib
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from deployments import deploydefaults, secrets
from deployments.models import ModelRepo, Node, Recipe
from deployments.recipes import resolve, schema
from plumbing import recipefiles
from plumbing.errors import ServiceError

__all__ = ["SHIPPED", "Choice", "Use", "recipes_sync", "recipe_import", "recipes_loaded", "recipes_for_model",
           "recipe_resolve", "recipe_choice", "recipe_use", "recipe_changes",
           "recipe_summary"]
SHIPPED = Path(__file__).resolve().parent.parent / "recipes" / "data"
_synced: dict[str, tuple] = {}  # folder -> (fingerprint, errors): each process reads a folder again only when it changed


@dataclass(frozen=True)
class Choice:
    """A recipe (its row id), one of its variants and one of its strategies, as the form, API and CLI name them."""

    recipe: int
    variant: str = "default"
    strategy: str = ""

    def __str__(self):
        return f"{self.recipe}:{self.variant}:{self.strategy}"


def _folder() -> tuple[Path, str]:
    folder = getattr(settings, "RECIPES_DIR", "") or ""
    return (Path(folder), f"folder:{folder}") if folder else (SHIPPED, "panel")


def _parse(files: list[tuple[str, str]]) -> tuple[list, list[str]]:
    parsed, errors = [], []
    for path, text in files:
        try:
            kind, name, data, _ = schema.parse(path, text)
        except schema.RecipeError as exc:
            errors.append(str(exc))
            continue
        parsed.append((kind, name, path, data, hashlib.sha256(text.encode()).hexdigest()))
    seen = {}
    for kind, name, path, *_ in parsed:
        if (kind, name.lower()) in seen:
            errors.append(f"{path}: {'model.model_id' if kind == 'model' else 'name'}: {name} is also in {seen[kind, name.lower()]}")
        seen[kind, name.lower()] = path
    return parsed, errors


@transaction.atomic
def _store(parsed: list, source: str, version: str) -> dict:
    """Rows for `parsed` under `source`; rows of that source not among them are deleted. Counts by kind."""
    keep = []
    for kind, name, path, data, digest in parsed:
        row = Recipe.objects.filter(kind=kind, name=name, source=source).first()
        fields = {"version": version or f"sha256:{digest[:12]}", "path": path, "digest": digest, "data": data}
        if row is None:
            row = Recipe.objects.create(kind=kind, name=name, source=source, **fields)
        elif row.digest != digest or row.version != fields["version"] or row.path != path:
            Recipe.objects.filter(pk=row.pk).update(**fields)
        keep.append(row.pk)
    Recipe.objects.filter(source=source).exclude(pk__in=keep).delete()
    return {"models": sum(1 for p in parsed if p[0] == "model"), "strategies": sum(1 for p in parsed if p[0] == "strategy")}


def recipes_sync(force: bool = False) -> list[str]:
    """Read the recipes folder again if its files changed since this process last read it; a malformed file
    is left out (its error returned, naming file and field) and the others load."""
    folder, source = _folder()
    try:
        stats = tuple((p.as_posix(), p.stat().st_mtime_ns, p.stat().st_size) for p in recipefiles.paths(folder))
    except OSError as exc:
        return [f"{folder}: {exc}"]
    # Unchanged files and their rows still there (a restore or a test's rollback takes them): nothing to read.
    if not force and _synced.get(str(folder), (None,))[0] == stats and Recipe.objects.filter(source=source).exists():
        return _synced[str(folder)][1]
    if not stats:
        errors = [f"{folder}: no models/<org>/<model>.yaml or strategies/<name>.yaml in it"]
    else:
        try:
            parsed, errors = _parse(recipefiles.read(folder))
            _store(parsed, source, recipefiles.version(folder))
        except recipefiles.CheckoutError as exc:
            errors = [str(exc)]
        except IntegrityError:  # another process stored the same files first: theirs are as good
            pass
    _synced[str(folder)] = (stats, errors)
    return errors


def recipe_import(files: list[tuple[str, str]], source: str, version: str = "") -> dict:
    """Store the recipe and strategy files of a checkout under `import:<source>` (replacing that source's
    earlier import), or refuse all of them when one is malformed, naming each file and field."""
    if not files:
        raise ServiceError("No recipe files: expected models/<org>/<model>.yaml or strategies/<name>.yaml.", field="files")
    parsed, errors = _parse(files)
    if errors:
        raise ServiceError("Nothing imported: " + "; ".join(errors[:20]) + (f"; and {len(errors) - 20} more" if len(errors) > 20
                                                                              else "") + ".", field="files")
    return {**_store(parsed, f"import:{source}", version), "source": f"import:{source}"}


def recipes_loaded() -> tuple[list[tuple[Recipe, schema.Recipe]], dict[str, dict]]:
    """The model recipes (row, parsed) and the strategies by source (source -> name -> Strategy)."""
    recipes_sync()
    recipes, strategies = [], {}
    for row in Recipe.objects.all():
        try:
            if row.kind == Recipe.Kind.MODEL:
                recipes.append((row, schema.parse_recipe(row.data, row.path)))
            else:
                strategies.setdefault(row.source, {})[row.name] = schema.parse_strategy(row.data, row.path)
        except schema.RecipeError:  # stored by an older schema: left out until loaded again
            continue
    return recipes, strategies


def strategies_for(row: Recipe, strategies: dict) -> dict:
    """A recipe's strategies: the panel's, under those of its own source."""
    return {**strategies.get("panel", {}), **strategies.get(_folder()[1], {}), **strategies.get(row.source, {})}


def recipes_for_model(model: ModelRepo) -> list[tuple[Recipe, schema.Recipe, list[str]]]:
    """The recipes serving this model's repo, each with the variants that are this repo."""
    repo = model.repo_id.lower()
    out = []
    recipes, _ = recipes_loaded()
    for row, recipe in recipes:
        if repo not in recipe.model_ids():
            continue
        own = [n for n, v in recipe.variants.items() if (v.model_id or recipe.model_id).lower() == repo]
        out.append((row, recipe, own))
    return out


def gpu_bytes(node: Node, count: int, gpu_indices=None) -> int:
    gpus = sorted(node.gpus.all(), key=lambda g: g.index)
    chosen = [g for g in gpus if g.index in gpu_indices] if gpu_indices else gpus[:count]
    return sum(g.memory_total for g in chosen)


def recipe_choice(recipe, variant: str = "", strategy: str = "") -> Choice:
    """A Choice from what a caller typed: a recipe row id or model id (`moonshotai/Kimi-K2.5`, case-insensitive;
    several sources: the id is needed), or "id:variant:strategy"."""
    text = str(recipe).strip()
    if text.count(":") == 2 and text.split(":")[0].isdigit():  # the deploy form's "id:variant:strategy"
        text, given_variant, given_strategy = text.split(":")
        variant, strategy = variant or given_variant, strategy or given_strategy
    if text.isdigit():
        row = Recipe.objects.filter(pk=int(text), kind=Recipe.Kind.MODEL).first()
        rows = [row] if row else []
    else:
        recipes_sync()
        rows = list(Recipe.objects.filter(kind=Recipe.Kind.MODEL, name__iexact=text))
    if not rows:
        raise ServiceError(f"No recipe {text[:80]!r}: see the model's page or `panelctl recipes list`.", field="recipe",
                           code="not_found")
    if len(rows) > 1:
        raise ServiceError(f"{text} has recipes from several sources: give the id ("
                           + ", ".join(f"{r.pk}: {r.source}" for r in rows) + ").", field="recipe")
    return Choice(rows[0].pk, variant or "default", strategy)


def recipe_resolve(choice: Choice, node: Node, gpu_indices: list[int] | None = None, nnodes: int = 1):
    """(row, parsed recipe, Resolved) for the choice on these GPUs of the node (all of them when None); an
    empty strategy takes the recipe's first that applies. ServiceError naming the field otherwise."""
    row = Recipe.objects.filter(pk=choice.recipe, kind=Recipe.Kind.MODEL).first()
    if row is None:
        raise ServiceError(f"No recipe {choice.recipe}.", field="recipe", code="not_found")
    try:
        recipe = schema.parse_recipe(row.data, row.path)
    except schema.RecipeError as exc:
        raise ServiceError(f"The recipe no longer reads: {exc}", field="recipe") from exc
    _, strategies = recipes_loaded()
    plans = strategies_for(row, strategies)
    target = resolve.Target.of_node(node, gpu_indices or None, nnodes)
    strategy = choice.strategy or next(iter(resolve.strategies_for(recipe, plans, target)), "")
    if not strategy:
        raise ServiceError(f"No strategy of {recipe.model_id} applies to {node}'s {target.gpus} GPU(s).", field="strategy")
    try:
        return row, recipe, resolve.resolve(recipe, plans, choice.variant or "default", strategy, target)
    except resolve.ResolveError as exc:
        raise ServiceError(f"{recipe.model_id}: {exc}.", field="strategy" if "strateg" in str(exc) else "variant") from exc


@dataclass
class Use:
    """A recipe a deploy starts from: the choice resolved on the node, the deploy form's values for it (what the
    form, the API and panelctl all send when nothing is changed) and the GPUs it takes by default."""

    row: Recipe
    resolved: resolve.Resolved
    defaults: tuple  # (engine_args, env)
    gpu_indices: list


def recipe_use(choice: Choice, node: Node, gpu_indices: list[int] | None = None, nnodes: int = 1,
               served_name: str = "") -> Use:
    """What a deploy from this recipe gets on the node when the caller changes nothing, served under
    `served_name` as the form fills it in (ServiceError naming the field when the choice does not apply)."""
    row, _, resolved = recipe_resolve(choice, node, gpu_indices, nnodes)
    initial = deploydefaults.flags_initial(resolved.flags, resolved.env)
    if served_name:
        initial["served_model_name"] = served_name
    defaults = deploydefaults.form_defaults(node, initial=initial)
    first = [g.index for g in sorted(node.gpus.all(), key=lambda g: g.index)][:resolved.gpus]
    return Use(row, resolved, defaults, sorted(gpu_indices) if gpu_indices else first)


def recipe_changes(use: Use, engine_args: dict, env: dict, served_name: str = "", secret_env=()) -> dict:
    """What the deploy changed from the recipe: {"--flag" or "VAR": [recipe's value, the deploy's]} (None: unset);
    secret values masked (this goes to the timeline)."""
    flags, variables = secrets.mask(use.defaults[0]), secrets.mask(use.defaults[1], secret_env)
    engine_args, env = secrets.mask(engine_args), secrets.mask(env, secret_env)
    changed = {}
    for name in dict.fromkeys([*flags, *engine_args]):
        old, new = flags.get(name), engine_args.get(name)
        if str(old) != str(new) and not (name == "served-model-name" and old is None and new == served_name):
            changed[f"--{name}"] = [old, new]
    for name in dict.fromkeys([*variables, *env]):
        if variables.get(name) != env.get(name):
            changed[name] = [variables.get(name), env.get(name)]
    return changed


def recipe_summary(use: Use, changed: dict) -> str:
    """One line for the timeline: which recipe, from where, and what the deploy changed."""
    r = use.resolved
    text = f"Recipe {r.label()} ({use.row.source}, {use.row.version})"
    if not changed:
        return text + ", unchanged."

    def show(value):
        return "unset" if value is None else ("on" if value is True else str(value))
    return text + "; changed: " + ", ".join(f"{k} {show(v[1])} (recipe: {show(v[0])})" for k, v in changed.items()) + "."
