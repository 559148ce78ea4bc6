#!/usr/bin/env python3
"""Write the exit-code table of docs/faults.md from ``speculators_v016.exit_codes.ExitCode``.

python tools/exit_codes_table.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from speculators_v016.exit_codes import markdown_table  # noqa: E402

PAGE = ROOT / "docs" / "faults.md"
BEGIN, END = "<!-- exit-codes:begin -->", "<!-- exit-codes:end -->"


def render(text: str) -> str:
    """``text`` with the table between the markers regenerated."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{PAGE} has no {BEGIN} ... {END} markers")
    return text[: text.index(BEGIN) + len(BEGIN)] + "\n" + markdown_table() + "\n" + text[text.index(END) :]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page's table differs (write nothing)")
    args = ap.parse_args()
    text = PAGE.read_text()
    try:
        new = render(text)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.check:
        return 0 if new == text else 1
    PAGE.write_text(new)
    print(f"wrote the exit-code table to {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
