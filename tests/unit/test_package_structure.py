"""The package's shape: no import cycles, and the engine side never loads worker code."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "speculators_v016"


def _imports(path: Path) -> set[str]:
    """Modules of speculators_v016 that a file imports, at any depth (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("speculators_v016"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("speculators_v016."))
    return found


def _graph() -> dict[str, set[str]]:
    graph = {
        "speculators_v016." + ".".join(p.relative_to(ROOT).with_suffix("").parts): _imports(p)
        for p in ROOT.rglob("*.py")
        if p.stem != "__init__"
    }
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles_in_our_package():
    """Our modules import each other without a cycle (e.g. manifest and writer used to)."""
    graph = _graph()
    state: dict[str, int] = {}

    def visit(module, path):
        if state.get(module) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path + [module]))
        if state.get(module) == 2:
            return
        state[module] = 1
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])


def test_engine_and_store_never_import_worker_code():
    """The engine side and the store reach the worker only through the protocol module."""
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith(("speculators_v016.engine.", "speculators_v016.store.")):
            worker = sorted(d for d in deps if d.startswith("speculators_v016.worker."))
            assert not worker, f"{module} imports worker code {worker}"


def test_production_code_never_imports_the_test_kit():
    """Fault injection and tiny-model builders stay out of the production path (the demo may build a model)."""
    graph = _graph()
    for module, deps in graph.items():
        if module.startswith("speculators_v016.testing.") or module == "speculators_v016.run.demo":
            continue
        kit = sorted(d for d in deps if d.startswith("speculators_v016.testing."))
        assert not kit, f"{module} imports the test kit {kit}"
