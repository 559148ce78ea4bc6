"""The exit codes of ``speculators-data-gen``, each with its meaning: the one place they are stated.

``--help``'s epilog (``help_text``) and the table in ``docs/faults.md`` (``markdown_table``,
written by ``tools/exit_codes_table.py``) are generated from this enum; a unit test keeps both in
step with it. Code 2 is click's own usage error, raised before a run starts.
"""

from __future__ import annotations

import enum
import textwrap


class ExitCode(enum.IntEnum):
    """What the process's exit status means."""

    OK = 0, "done (or verified)"
    PROBLEMS_FOUND = 1, "verify/check found problems"
    USAGE = 2, "usage error"
    BAD_INPUT = 3, "bad input data"
    OUTPUT_REFUSED = (
        4,
        "output folder refused (foreign files, locked, settings differ from the run being resumed, "
        "not writable, another layout)",
    )
    GENERATION_FAILED = (
        5,
        "generation failed (engine, model, NaN/Inf limit, a writer thread failing other than by the disk)",
    )
    WRITE_FAILED = 6, "a file could not be written (disk full)"
    SELF_CHECK_FAILED = (
        7,
        "the run's self-check failed (captured states do not reproduce the model's logits, or no "
        "model produces them): nothing it judged was written",
    )
    INTERRUPTED = 130, "interrupted"

    meaning: str

    def __new__(cls, value: int, meaning: str):
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member


def help_text(width: int = 80) -> str:
    """The exit codes as one paragraph for ``--help`` (click keeps a paragraph after ``\\b`` as written)."""
    text = "Exit codes: " + "; ".join(f"{code.value} {code.meaning}" for code in ExitCode) + "."
    return textwrap.fill(text, width=width, break_on_hyphens=False)


def markdown_table() -> str:
    """The exit codes as a markdown table: code, name, meaning."""
    rows = ["| exit | name | meaning |", "|---|---|---|"]
    rows += [f"| {code.value} | `{code.name}` | {code.meaning} |" for code in ExitCode]
    return "\n".join(rows)
