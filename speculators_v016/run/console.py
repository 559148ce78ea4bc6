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

import errno
import os
import stat
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TextIO

from loguru import logger

from speculators_v016.store import no_links
from speculators_v016.store.outdir import SHARD_DIR, is_ours

MODES = ("normal", "verbose", "quiet")
TAIL_LINES = 12


def log_path(folder: Path, kind: str, suffix: str = "") -> Path:
    """``folder/logs/<kind>-<UTC time>[suffix].log``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(folder) / "logs" / f"{kind}-{stamp}{suffix}.log"


def _private(folder: Path) -> bool:
    """Is ``folder`` a real folder (not a link) of this user that nobody else can enter?"""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def private_dir() -> Path:
    """A folder for logs that belong to no output folder, only this user's: ``$XDG_RUNTIME_DIR/speculators-
    data-gen`` where the session has one, else ``<tmp>/speculators-data-gen-<uid>`` (made 0700); where
    that name is taken by anything else (another user's folder, a link), a fresh ``mkdtemp`` folder."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    candidates = [Path(runtime) / "speculators-data-gen"] if runtime and _private(Path(runtime)) else []
    candidates.append(Path(tempfile.gettempdir()) / f"speculators-data-gen-{os.geteuid()}")
    for folder in candidates:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError:
            continue
        if _private(folder):
            return folder
    return Path(tempfile.mkdtemp(prefix=f"speculators-data-gen-{os.geteuid()}-"))


def run_log_path(output_dir: Path, kind: str = "run", suffix: str = "") -> Path:
    """The log of a run: in ``output_dir/logs`` (shared by the shards of a sharded run), unless that folder
    holds files not ours (the run will refuse it, and we add nothing to it): then in :func:`private_dir`."""
    out = Path(output_dir)
    try:
        foreign = out.exists() and (
            not out.is_dir()
            or any(not is_ours(n) and not SHARD_DIR.match(n) for n in os.listdir(out))
            or bool(no_links.links_in(out))  # a link (``logs`` among them) is never written through
        )
    except OSError:
        foreign = True
    if foreign:
        return private_dir() / log_path(out, kind, suffix).name
    return log_path(out, kind, suffix)


def scratch_log_path(kind: str) -> Path:
    """The log of a command that writes no folder of its own (verify, check): in :func:`private_dir`."""
    return private_dir() / log_path(Path("."), kind).name


def open_log(path: Path, mode: int = 0o644) -> tuple[int, Path]:
    """(fd, path) of a new log file at ``path``, or ``path`` with ``-2``, ``-3`` ... before ``.log`` where that
    name exists: never an existing file, never through a symbolic link (O_EXCL | O_NOFOLLOW). Its folder (``logs``
    of an output folder, or the private one) is made where absent and opened without following a link
    (``O_DIRECTORY | O_NOFOLLOW``, :func:`speculators_v016.store.no_links.open_subfolder`), the file relative to
    it: a ``logs`` that is a link to another folder raises, and nothing is made there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC
    path.parent.parent.mkdir(parents=True, exist_ok=True)  # the output folder, as the user named it
    folder = no_links.open_subfolder(path.parent.parent, path.parent.name)
    try:
        for n in range(1, 100):
            candidate = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
            try:
                return os.open(candidate.name, flags, mode, dir_fd=folder), candidate
            except FileExistsError:
                continue
    finally:
        os.close(folder)
    raise FileExistsError(errno.EEXIST, "too many log files of the same second", str(path))


class Console:
    def __init__(self, log_file: Path | None, mode: str = "normal", log_level: str = "INFO"):
        if mode not in MODES:
            raise ValueError(f"console mode {mode!r}: choose from {MODES}")
        self.log_file = Path(log_file) if log_file is not None and mode != "verbose" else None
        self.mode, self.log_level = mode, log_level.upper()
        self.out: TextIO = sys.stdout
        self.err: TextIO = sys.stderr
        self._saved: tuple[int, int] | None = None
        self.fallback = ""  # why the log is not where it was asked for
        self._env: dict[str, str] = {}  # the variables this console set (not there before): unset again on close

    # -- set-up -----------------------------------------------------------
    def __enter__(self) -> Console:
        fd = self._open_log() if self.log_file is not None else None
        if fd is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            self._saved = (os.dup(1), os.dup(2))
            self.out = os.fdopen(os.dup(self._saved[0]), "w", buffering=1, encoding="utf-8", errors="replace")
            self.err = os.fdopen(os.dup(self._saved[1]), "w", buffering=1, encoding="utf-8", errors="replace")
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            self._set_default("VLLM_LOGGING_LEVEL", "INFO")  # it is all in the log now
        else:
            self._set_default("VLLM_LOGGING_LEVEL", "WARNING" if self.mode == "quiet" else "INFO")
        self._set_default("VLLM_CONFIGURE_LOGGING", "1")
        logger.remove()
        logger.enable("speculators_v016")
        if self.log_file is not None:  # the full record, in the log
            logger.add(
                sys.stderr,
                level=self.log_level,
                format="{time:YYYY-MM-DD HH:mm:ss} | {level: <7} | {name}:{line} | {message}",
            )
        logger.add(self.err, level="DEBUG", format=self._terminal_format, filter=self._for_terminal, colorize=False)
        if self.fallback:
            logger.warning("cannot write the log in {}; it is in {}", self.fallback, self.log_file)
        return self

    def _set_default(self, name: str, value: str) -> None:
        """``os.environ[name] = value`` unless the caller set it; remembered, so :meth:`close` unsets it again."""
        if name not in os.environ:
            os.environ[name] = self._env[name] = value

    def _open_log(self) -> int | None:
        """The log file's descriptor: at ``log_file``, else (its folder cannot be made or written: read-only,
        no permission, disk full) in :func:`private_dir`; None (no log, everything on the terminal) when
        neither works."""
        folder = self.log_file.parent
        try:
            fd, self.log_file = open_log(self.log_file, 0o600 if _private(folder) else 0o644)
            return fd
        except OSError as exc:
            reason = f"{folder}: {exc.strerror or exc}"
        try:
            fd, self.log_file = open_log(private_dir() / self.log_file.name, 0o600)
            self.fallback = reason
            return fd
        except OSError:
            self.log_file, self.mode = None, "verbose"
            return None

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        logger.remove()
        logger.disable("speculators_v016")  # the library is quiet again once the command is done (in-process callers)
        for name, value in self._env.items():  # a quiet command's WARNING must not stay for the caller's next one
            if os.environ.get(name) == value:
                del os.environ[name]
        self._env = {}
        if self._saved is None:
            return
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # the log's disk is full: what is left in the buffers must not reach the terminal
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._saved[0])
            os.dup2(null, self._saved[1])
            os.close(null)
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
            record["level"].no >= 30 and record["name"].startswith("speculators_v016")
        )

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

    def log_trouble(self) -> str | None:
        """Why the log file cannot be written (its disk full, a quota), or None while it can: what is pending
        for it is flushed and one newline written to it, so a full disk shows now."""
        if self._saved is None or self.log_file is None:
            return None
        try:
            sys.stderr.flush()
            os.write(2, b"\n")
        except OSError as exc:
            return exc.strerror or str(exc)
        return None

    def _warn_log(self, trouble: str) -> None:
        self.echo(
            f"warning: the log {self.log_file} could not be written ({trouble}): it holds nothing or only "
            "its start; run again with -v to see everything on the terminal",
            err=True,
        )

    def failure(self, message: str) -> None:
        """Our explanation, then where the full log is and its last lines (or that it could not be written)."""
        self.echo(message, err=True)
        if self.log_file is None:
            return
        trouble = self.log_trouble()
        if trouble:
            self._warn_log(trouble)
            return
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:  # the log's disk is full; what it holds is shown below
            pass
        tail = [line for line in _tail(self.log_file) if line.strip()][-TAIL_LINES:]
        if tail:
            self.echo(f"last lines of the log ({self.log_file}):", err=True)
            for line in tail:
                self.echo(f"  | {line}", err=True)
        else:
            self.echo(f"log: {self.log_file}", err=True)

    def log_exception(self, exc: BaseException) -> None:
        """The traceback of ``exc``, in the log (with --verbose: on the terminal); nothing if it cannot be written
        (a full disk): the terminal already has our message, and the exit code stays the error's."""
        try:
            traceback.print_exception(exc, file=sys.stderr)
            sys.stderr.flush()
        except OSError:
            pass

    def where(self) -> None:
        if self.log_file is None:
            return
        trouble = self.log_trouble()
        if trouble:
            self._warn_log(trouble)
        else:
            self.echo(f"log:        {self.log_file}", summary=True)


def _tail(path: Path, size: int = 16384) -> list[str]:
    try:
        with no_links.open_to_read(path) as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - size))
            return fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []
