"""The terminal of one CLI command: our lines on it, everything else in a log file.

A run's terminal would otherwise interleave vLLM's logging, torch and Gloo
messages written by C++ code, upstream's logging, ``datasets`` progress bars
and what vLLM's worker processes print. :class:`Console` points the process's
file descriptors 1 and 2 at a log file (so C/C++ code and every child
process inherit it) and keeps duplicates of the terminal's for our own
output: the start line, one progress bar, warnings that change the result,
the summary and errors. ``verbose`` leaves the descriptors alone (everything
on the terminal, as without us); ``quiet`` shows the summary and errors only.

Only the CLI uses this; the library never touches a caller's descriptors.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

MODES = ("normal", "verbose", "quiet")
TAIL_LINES = 12


def log_path(folder: Path, kind: str, suffix: str = "") -> Path:
    """``folder/logs/<kind>-<UTC time>[suffix].log``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(folder) / "logs" / f"{kind}-{stamp}{suffix}.log"


def run_log_path(output_dir: Path, kind: str = "run", suffix: str = "") -> Path:
    """The log of a run: in ``output_dir/logs``, unless that folder holds files not ours (the run will
    refuse it, and we add nothing to it): then in the temporary folder."""
    from speculators_v016.store.outdir import is_ours

    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(not is_ours(n) for n in os.listdir(out))):
        return log_path(Path(tempfile.gettempdir()) / "speculators-data-gen", kind, suffix)
    return log_path(out, kind, suffix)


def scratch_log_path(kind: str) -> Path:
    """The log of a command that writes no folder of its own (verify, check)."""
    return log_path(Path(tempfile.gettempdir()) / "speculators-data-gen", kind)


class Console:
    def __init__(self, log_file: Path | None, mode: str = "normal", log_level: str = "INFO"):
        if mode not in MODES:
            raise ValueError(f"console mode {mode!r}: choose from {MODES}")
        self.log_file = Path(log_file) if log_file is not None and mode != "verbose" else None
        self.mode, self.log_level = mode, log_level.upper()
        self.out: TextIO = sys.stdout
        self.err: TextIO = sys.stderr
        self._saved: tuple[int, int] | None = None

    # -- set-up -----------------------------------------------------------
    def __enter__(self) -> Console:
        from loguru import logger

        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            sys.stdout.flush()
            sys.stderr.flush()
            self._saved = (os.dup(1), os.dup(2))
            self.out = os.fdopen(os.dup(self._saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
            self.err = os.fdopen(os.dup(self._saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
            fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # it is all in the log now
        else:
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING" if self.mode == "quiet" else "INFO")
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
        logger.remove()
        logger.enable("speculators_v016")
        if self.log_file is not None:  # the full record, in the log
            logger.add(sys.stderr, level=self.log_level, format="{time:YYYY-MM-DD HH:mm:ss} | {level: <7} | "
                       "{name}:{line} | {message}")
        logger.add(self.err, level="DEBUG", format=self._terminal_format, filter=self._for_terminal, colorize=False)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        from loguru import logger

        logger.remove()
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        self._saved = None
        for stream in (self.out, self.err):
            stream.flush()

    # -- what the terminal shows -------------------------------------------
    def _for_terminal(self, record) -> bool:
        if self.mode == "verbose":
            return record["level"].no >= 20 or record["extra"].get("terminal", False)
        if self.mode == "quiet":
            return record["level"].no >= 40
        return record["extra"].get("terminal", False) or (
            record["level"].no >= 30 and record["name"].startswith("speculators_v016"))

    @staticmethod
    def _terminal_format(record) -> str:
        level = record["level"].name
        prefix = "" if level in ("INFO", "SUCCESS") else f"{level.lower()}: "
        return prefix + "{message}\n"

    @property
    def progress(self) -> bool:
        return self.mode != "quiet"

    def echo(self, line: str = "", err: bool = False, summary: bool = False) -> None:
        """A line of ours; in quiet mode only the summary (and errors, ``err``) are shown."""
        if self.mode == "quiet" and not (summary or err):
            return
        stream = self.err if err else self.out
        stream.write(line + "\n")
        stream.flush()

    def failure(self, message: str) -> None:
        """Our explanation, then where the full log is and its last lines."""
        self.echo(message, err=True)
        if self.log_file is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        tail = [line for line in _tail(self.log_file) if line.strip()][-TAIL_LINES:]
        if tail:
            self.echo(f"last lines of the log ({self.log_file}):", err=True)
            for line in tail:
                self.echo(f"  | {line}", err=True)
        else:
            self.echo(f"log: {self.log_file}", err=True)

    def where(self) -> None:
        if self.log_file is not None:
            self.echo(f"log:        {self.log_file}", summary=True)


def _tail(path: Path, size: int = 16384) -> list[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - size))
            return fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []
