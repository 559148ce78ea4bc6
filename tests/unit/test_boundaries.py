"""The package's shape, kept by parsing every import (functions included): the boundaries its docstrings
state, in both directions, and no import cycle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "speculators_v016"
P = "speculators_v016."

#: (modules the rule is about, what they must never import, the claim it keeps). A name ending in "."
#: is a package (its __init__ and every module in it); any other name is one module; EVERY is every
#: module, and a name after "-" is left out of the rule.
EVERY = "*"
RULES = [
    (
        ("worker.",),
        ("engine.", "run.", "store.", "checks.", "generator"),
        "worker/__init__, protocol: the worker side never loads the engine loop; it shares only protocol and shared/",
    ),
    (
        ("engine.",),
        ("worker.", "run.", "store.", "checks."),
        "engine/__init__, protocol: the engine side never loads worker code, the store or a run",
    ),
    (
        ("protocol", "shared."),
        ("engine.", "worker.", "run.", "store.", "checks.", "generator"),
        "protocol, shared/__init__: what both sides import imports neither",
    ),
    (
        ("store.",),
        ("engine.", "worker.", "run.", "generator"),
        "store/__init__: the store never imports the engine, the worker or a run",
    ),
    (
        ("checks.",),
        ("engine.", "worker.", "run.", "store.", "generator"),
        "checks/__init__: the self-checks judge states; they import no engine, worker, store or run",
    ),
    (
        ("testing.",),
        ("run.", "cli"),
        "testing/__init__: the test kit never imports the CLI (faults run the installed command)",
    ),
    (
        (EVERY, "-testing.", "-run.demo"),
        ("testing.",),
        "testing/__init__: no production code imports the test kit (the demo builds its model with it)",
    ),
    (
        ("engine.", "worker.", "store.", "checks.", "shared.", "protocol", "generator", "fp8", "layers", "target"),
        ("run.",),
        "run/__init__: a run is the top of the package; nothing below imports it",
    ),
    (
        (
            "engine.",
            "worker.",
            "store.",
            "checks.",
            "shared.",
            "protocol",
            "generator",
            "fp8",
            "layers",
            "target",
            "run.",
            "-run.cli",
        ),
        ("serve.", "online."),
        "serve/__init__: the service and its consumer sit on top, beside a run; nothing below imports them",
    ),
    (
        ("online.",),
        ("engine.", "worker.", "generator", "run.", "serve.service", "serve.http_api", "serve.driver"),
        "online/__init__: the consumer runs in a trainer's processes: it never loads the engine or a run",
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

    def hit(name: str) -> bool:
        if name.endswith("."):  # the package: its __init__ and every module in it
            return short == name[:-1] or short.startswith(name)
        return name == EVERY or short == name

    left_out = [n[1:] for n in names if n.startswith("-")]
    return any(hit(n) for n in names if not n.startswith("-")) and not any(hit(n) for n in left_out)


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


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import cycle of ``graph`` (module -> modules it imports) as its path, or None."""
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        if state.get(module) == 1:
            return path + [module]
        if state.get(module) == 2:
            return None
        state[module] = 1
        for dep in sorted(d for d in graph[module] if d in graph and d != module):
            found = visit(dep, path + [module])
            if found:
                return found
        state[module] = 2
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


def _graph() -> dict[str, set[str]]:
    return {name: imports_of(path.read_text()) for name, path in _modules().items()}


def test_every_boundary_the_docstrings_claim_holds():
    """No module imports across a boundary its package's docstring claims (worker/engine both ways, store, ...)."""
    graph = _graph()
    assert not violations(graph), "\n".join(violations(graph))


def test_no_import_cycles_in_our_package():
    """Our modules import each other without a cycle (e.g. manifest and writer used to)."""
    found = cycle(_graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_a_cycle_is_found():
    """The cycle check is not vacuous: a planted cycle (through a function-level import too) is reported."""
    planted = {f"{P}a": {f"{P}b"}, f"{P}b": {f"{P}c"}, f"{P}c": {f"{P}a", f"{P}c"}, f"{P}d": {f"{P}a"}}
    assert cycle(planted) == [f"{P}a", f"{P}b", f"{P}c", f"{P}a"]
    assert cycle({f"{P}a": {f"{P}b"}, f"{P}b": {f"{P}b"}}) is None  # a module naming itself is no cycle


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
        "speculators_v016.run.run_report": {"speculators_v016.serve.driver"},
        "speculators_v016.online.dataset": {"speculators_v016.serve.service", "speculators_v016.generator"},
        "speculators_v016.serve.service": set(),
        "speculators_v016.serve.driver": set(),
        "speculators_v016.generator": set(),
    }
    found = violations(planted)
    for module, deps in planted.items():
        if module.startswith("speculators_v016.run.") and module != "speculators_v016.run.run_report":
            assert not any(v.startswith(module + " ") for v in found)  # a run may import what is below it
        for dep in deps:
            if not module.startswith("speculators_v016.run."):
                assert any(v.startswith(f"{module} imports {dep} ") for v in found), (module, dep)


def test_the_test_kit_stays_out_of_production_code():
    """Every production module importing the test kit is reported; the kit itself and the demo may use it."""
    kit = {"speculators_v016.testing.tiny_models", "speculators_v016.testing.faults"}
    planted = {
        "speculators_v016.run.pipeline": kit,
        "speculators_v016.engine.core": kit,
        "speculators_v016.worker.capture": kit,
        "speculators_v016.store.writer": kit,
        "speculators_v016.generator": kit,
        "speculators_v016.config": kit,
        "speculators_v016": kit,
        "speculators_v016.run.demo": {"speculators_v016.testing.tiny_models"},
        "speculators_v016.testing.tiny_quant": {"speculators_v016.testing.tiny_models"},
        "speculators_v016.testing.tiny_models": set(),
        "speculators_v016.testing.faults": set(),
    }
    found = violations(planted)
    for module, deps in planted.items():
        for dep in deps:
            expected = not module.startswith(("speculators_v016.testing.", "speculators_v016.run.demo"))
            assert any(v.startswith(f"{module} imports {dep} ") for v in found) == expected, (module, dep)


def test_imports_are_found_in_functions_and_as_submodules():
    """A function-level `from speculators_v016.x import y` counts, as the module and as x.y."""
    source = "def f():\n    from speculators_v016.shared import slot_ring\n    import speculators_v016.run.cli\n"
    assert imports_of(source) == {
        "speculators_v016.shared",
        "speculators_v016.shared.slot_ring",
        "speculators_v016.run.cli",
    }
