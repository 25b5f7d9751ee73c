"""The import graph of the panel's own packages, read from the source with `ast` (every `import` and `from`,
at module level and inside functions, relative ones resolved): no cycle anywhere, and node-side code
(deployments/node, deployments/host) never imports a control-plane service, view, API, form or wiring module.
Reading the source rather than importing it keeps this fast and catches imports hidden inside functions."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("controlpanel", "deployments", "benchmarks", "plumbing", "panelctl")
NODE_SIDE = ("deployments.node", "deployments.host")
CONTROL_PLANE = ("deployments.services", "deployments.views", "deployments.api", "deployments.forms",
                 "controlpanel.settings", "controlpanel.urls", "controlpanel.asgi", "controlpanel.routing")
# (importer, imported) pairs known to break the rules above and not yet fixed; keep this empty.
KNOWN = set()


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, known) -> set[str]:
    """The panel's modules `name` imports anywhere in its body (a name taken from a package counts as the package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    modules = set()
    for imported in names:
        while imported and imported not in known:
            imported = imported.rpartition(".")[0]
        if imported and imported != name:
            modules.add(imported)
    return modules


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imported(name, path, known) - {b for a, b in KNOWN if a == name} for name, path in known.items()}


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def _within(module: str, prefixes) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def test_the_panels_packages_import_each_other_without_a_cycle():
    cycles = _cycles(_graph())
    assert cycles == [], f"import cycles (each a set of modules that import one another): {cycles}"


def test_node_side_code_never_imports_control_plane_modules():
    graph = _graph()
    crossings = sorted((name, imported) for name, imports in graph.items() if _within(name, NODE_SIDE)
                       for imported in imports if _within(imported, CONTROL_PLANE))
    assert crossings == [], f"node-side modules importing control-plane ones: {crossings}"


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    """The reader itself: a cycle hidden by a function-local relative import is found."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def late():\n    from .a import thing\n")
    known = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py", "pkg": tmp_path / "__init__.py"}
    graph = {name: _imported(name, path, known) for name, path in known.items() if name != "pkg"}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_module_is_over_450_lines():
    """A module a newcomer can read in one sitting: past 450 lines, split it by what its parts do."""
    long = {name: n for name, path in _modules().items()
            if "migrations" not in path.parts and (n := len(path.read_text().splitlines())) > 450}
    assert long == {}
