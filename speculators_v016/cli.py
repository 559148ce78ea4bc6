"""``python -m speculators_v016.cli``: kept for scripts; the command lives in :mod:`speculators_v016.run.cli`."""

from speculators_v016.run.cli import cli, main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    main()
