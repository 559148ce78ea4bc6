#!/usr/bin/env python3
"""Maintain the patch series: ``apply``, ``refresh``, ``check`` (see tools/patchtool)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from patchtool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
