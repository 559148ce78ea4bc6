"""The exit codes: one IntEnum, and --help and docs/faults.md generated from it and in step with it."""

import ast
import importlib.util
from pathlib import Path

from click.testing import CliRunner

from speculators_v016.exit_codes import ExitCode, markdown_table
from speculators_v016.run.cli import cli

ROOT = Path(__file__).resolve().parents[2]

#: The codes as they have been documented since the first release: neither value nor meaning may drift.
DOCUMENTED = {
    0: "done (or verified)",
    1: "verify/check found problems",
    2: "usage error",
    3: "bad input data",
    4: "output folder refused (foreign files, locked, settings differ from the run being resumed, not writable, "
    "another layout)",
    5: "generation failed (engine, model, NaN/Inf limit, a writer thread failing other than by the disk)",
    6: "a file could not be written (disk full)",
    7: "the run's self-check failed (captured states do not reproduce the model's logits, or no model produces "
    "them): nothing it judged was written",
    130: "interrupted",
}


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_enum_keeps_every_documented_value_and_meaning():
    """ExitCode has exactly the documented codes, each with its meaning, and its members are plain ints."""
    assert {code.value: code.meaning for code in ExitCode} == DOCUMENTED
    assert ExitCode.SELF_CHECK_FAILED == 7 and isinstance(ExitCode.INTERRUPTED, int)


def test_help_lists_every_exit_code_with_its_meaning():
    """`speculators-data-gen --help` states each code and its meaning, generated from the enum."""
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == ExitCode.OK, result.output
    epilog = _words(result.output[result.output.index("Exit codes:") :])
    for code in ExitCode:
        assert f"{code.value} {_words(code.meaning)}" in epilog, code


def test_the_docs_table_is_the_enum():
    """docs/faults.md holds exactly the generated table between its markers (tools/exit_codes_table.py)."""
    spec = importlib.util.spec_from_file_location("exit_codes_table", ROOT / "tools" / "exit_codes_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    text = (ROOT / "docs" / "faults.md").read_text()
    assert tool.render(text) == text, "docs/faults.md is stale: run python tools/exit_codes_table.py"
    for code in ExitCode:
        assert f"| {code.value} | `{code.name}` | {code.meaning} |" in markdown_table()


def test_no_bare_integer_exit_status_in_the_package():
    """sys.exit / ctx.exit / SystemExit in speculators_v016 take an ExitCode member, never a literal int."""
    bare = []
    for path in (ROOT / "speculators_v016").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("exit", "SystemExit") and any(
                isinstance(n, ast.Constant) and type(n.value) is int for n in ast.walk(node.args[0])
            ):
                bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bare, f"bare integer exit codes: {bare}"
