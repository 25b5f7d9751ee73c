"""The layers import one way, read from the source with `ast` (every import, inside functions too): controlpanel (the
wiring) may import the apps, deployments and benchmarks, which may import plumbing, which imports none of them;
benchmarks may import deployments, never the other way round.
panelctl, a client of the REST API, imports no Django package: of plumbing it takes only modules that need no Django."""
import ast
from pathlib import Path

from tests.test_import_graph import _graph, _modules

WIRING, APPS, PLUMBING, PANELCTL = "controlpanel", {"deployments", "benchmarks"}, "plumbing", "panelctl"
FRAMEWORKS = {"django", "rest_framework", "drf_spectacular", "django_htmx", "channels", "channels_redis", "celery",
              "kombu", "redis"}


def _package(module: str) -> str:
    return module.split(".")[0]


def _crossings(importers: set, imported: set) -> list[tuple[str, str]]:
    """(module, what it imports) for each module of `importers` importing one of `imported`'s."""
    return sorted((name, target) for name, targets in _graph().items() if _package(name) in importers
                  for target in targets if _package(target) in imported)


def _outside(path) -> set[str]:
    """The top-level names of the absolute imports in a file (libraries and the standard library alike)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_plumbing_imports_nothing_of_the_wiring_the_apps_or_panelctl():
    assert _crossings({PLUMBING}, {WIRING, PANELCTL, *APPS}) == []


def test_the_apps_import_nothing_of_the_wiring_or_panelctl():
    assert _crossings(APPS, {WIRING, PANELCTL}) == []


def test_deployments_imports_nothing_of_benchmarks():
    """A benchmark's live messages, CSV and models are its own: deployments learns of them only through what the
    benchmarks app registers (live topics, study steppers) in its AppConfig.ready()."""
    assert _crossings({"deployments"}, {"benchmarks"}) == []


def test_panelctl_imports_none_of_the_django_packages():
    assert _crossings({PANELCTL}, {WIRING, *APPS}) == []


def test_what_panelctl_takes_from_plumbing_runs_without_django():
    """panelctl runs where only its own dependencies are: each plumbing module it reaches (and the package itself)
    imports no web framework, task queue or Redis client."""
    graph, modules = _graph(), _modules()
    reached = {PLUMBING} | {t for name, targets in graph.items() if _package(name) == PANELCTL for t in targets
                            if _package(t) == PLUMBING}
    todo = list(reached)
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in reached:
                reached.add(target)
                todo.append(target)
    assert {m for m in reached if _package(m) != PLUMBING} == set()
    heavy = {m: sorted(_outside(modules[m]) & FRAMEWORKS) for m in reached}
    assert {m: names for m, names in heavy.items() if names} == {}


def test_every_package_says_what_lives_there_and_what_it_may_import():
    """Each package's __init__.py opens with a docstring that names what it may import (migrations aside)."""
    root = Path(__file__).resolve().parent.parent
    silent = []
    for top in (WIRING, *sorted(APPS), PLUMBING, PANELCTL):
        for init in sorted((root / top).rglob("__init__.py")):
            if "migrations" in init.parts:
                continue
            doc = ast.get_docstring(ast.parse(init.read_text(), str(init))) or ""
            if "import" not in doc:
                silent.append(str(init.relative_to(root)))
    assert not silent, "say in the package's docstring what lives there and what it may import: " + ", ".join(silent)
