"""The output folder: ours alone, one writer at a time, no leftovers trusted.

A folder is accepted when it is new, empty, or holds only what a run of ours
writes; anything else is refused (we never write among unrelated files). A
run holds an exclusive ``flock`` on a lock file for its whole life, so two
runs can never write the same folder. Temporary files left by a killed run
are removed when the next run takes the lock.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from speculators_v016.store.manifest import NAME as MANIFEST
from speculators_v016.store.sample_format import parse_sample_name
from speculators_v016.store.atomic_files import TMP_PREFIX

CONFIG = "data_config.json"
LOCK = ".speculators-data-gen.lock"
SHARD_DIR = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
LOGS = "logs"  # the CLI's log files (speculators_v016.run.console)
OURS = {CONFIG, MANIFEST, LOCK, LOGS}


class OutputDirError(RuntimeError):
    """The output folder cannot be used; the message says why and what to do."""


def is_ours(name: str) -> bool:
    return name in OURS or name.startswith(TMP_PREFIX) or parse_sample_name(name) is not None


def shard_name(index: int, count: int) -> str:
    """``shard-0000K-of-0000N``: the folder (and log-name suffix) of shard ``index`` of ``count``."""
    return f"shard-{index:05d}-of-{count:05d}"


def shard_dir(root: Path, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes (the root itself when not sharded)."""
    return root if count == 1 else root / shard_name(index, count)


class OutputDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock_fd: int | None = None

    def open(self) -> OutputDir:
        """Create or accept the folder, take the lock, clear temporary leftovers."""
        if self.path.exists() and not self.path.is_dir():
            raise OutputDirError(f"--output-dir {self.path} exists and is not a folder")
        self.path.mkdir(parents=True, exist_ok=True)
        foreign = sorted(n for n in os.listdir(self.path) if not is_ours(n))
        if foreign:
            raise OutputDirError(
                f"--output-dir {self.path} holds files this tool did not write "
                f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); "
                "use an empty or new folder")
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputDirError(f"another speculators-data-gen run (pid {holder}) is writing to "
                                 f"{self.path}; one run per folder") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self.removed_leftovers = [n for n in os.listdir(self.path) if n.startswith(TMP_PREFIX)]
        for name in self.removed_leftovers:
            (self.path / name).unlink()
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> OutputDir:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
