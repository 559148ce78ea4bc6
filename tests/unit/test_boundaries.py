"""The package's boundaries, as its docstrings state them, kept in both directions by parsing every import."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "speculators_v016"
P = "speculators_v016."

#: (modules the rule is about, what they must never import, the claim it keeps). A name ending in "."
#: is a package (every module in it); any other name is one module.
RULES = [
    (
        ("worker.",),
        ("engine.", "run.", "store.", "checks.", "generator", "testing."),
        "worker/__init__, protocol: the worker side never loads the engine loop; it shares only protocol and shared/",
    ),
    (
        ("engine.",),
        ("worker.", "run.", "store.", "checks.", "testing."),
        "engine/__init__, protocol: the engine side never loads worker code, the store or a run",
    ),
    (
        ("protocol", "shared."),
        ("engine.", "worker.", "run.", "store.", "checks.", "generator", "testing."),
        "protocol, shared/__init__: what both sides import imports neither",
    ),
    (
        ("store.",),
        ("engine.", "worker.", "run.", "generator", "testing."),
        "store/__init__: the store never imports the engine, the worker or a run",
    ),
    (
        ("checks.",),
        ("engine.", "worker.", "run.", "store.", "generator", "testing."),
        "checks/__init__: the self-checks judge states; they import no engine, worker, store or run",
    ),
    (
        ("testing.",),
        ("run.", "cli"),
        "testing/__init__: the test kit never imports the CLI (faults run the installed command)",
    ),
    (
        ("engine.", "worker.", "store.", "checks.", "shared.", "protocol", "generator", "fp8", "layers", "target"),
        ("run.",),
        "run/__init__: a run is the top of the package; nothing below imports it",
    ),
]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package's __init__ under the package's name)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[P + ".".join(parts) if parts else P.rstrip(".")] = path
    return out


def imports_of(source: str) -> set[str]:
    """Modules of the package that ``source`` imports, anywhere (functions and TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(P.rstrip(".")):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(P))
    return found


def _matches(module: str, names: tuple[str, ...]) -> bool:
    short = module.removeprefix(P)
    return any(short.startswith(n) if n.endswith(".") else short == n for n in names)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import in ``graph`` (module -> modules it imports) that breaks one of the RULES."""
    out = []
    for module, deps in sorted(graph.items()):
        for about, never, claim in RULES:
            if not _matches(module, about):
                continue
            for dep in sorted(d for d in deps if d in graph and _matches(d, never)):
                out.append(f"{module} imports {dep} ({claim})")
    return out


def test_every_boundary_the_docstrings_claim_holds():
    """No module imports across a boundary its package's docstring claims (worker/engine both ways, store, ...)."""
    modules = _modules()
    graph = {name: imports_of(path.read_text()) for name, path in modules.items()}
    assert not violations(graph), "\n".join(violations(graph))


def test_the_rules_catch_an_import_across_each_boundary():
    """A planted import across each boundary, in either direction, is reported (the checker is not vacuous)."""
    planted = {
        "speculators_v016.worker.capture": {"speculators_v016.engine.core"},
        "speculators_v016.engine.core": {"speculators_v016.worker.capture"},
        "speculators_v016.shared.slot_ring": {"speculators_v016.engine.core"},
        "speculators_v016.store.verify": {"speculators_v016.run.pipeline"},
        "speculators_v016.checks.fidelity": {"speculators_v016.run.dataset"},
        "speculators_v016.testing.faults": {"speculators_v016.run.cli"},
        "speculators_v016.run.pipeline": {"speculators_v016.engine.core", "speculators_v016.checks.finite"},
        "speculators_v016.run.dataset": set(),
        "speculators_v016.run.cli": set(),
        "speculators_v016.checks.finite": set(),
    }
    found = violations(planted)
    for module, deps in planted.items():
        if module.startswith("speculators_v016.run."):
            assert not any(v.startswith(module + " ") for v in found)  # a run may import what is below it
        for dep in deps:
            if not module.startswith("speculators_v016.run."):
                assert any(v.startswith(f"{module} imports {dep} ") for v in found), (module, dep)


def test_imports_are_found_in_functions_and_as_submodules():
    """A function-level `from speculators_v016.x import y` counts, as the module and as x.y."""
    source = "def f():\n    from speculators_v016.shared import slot_ring\n    import speculators_v016.run.cli\n"
    assert imports_of(source) == {
        "speculators_v016.shared",
        "speculators_v016.shared.slot_ring",
        "speculators_v016.run.cli",
    }
