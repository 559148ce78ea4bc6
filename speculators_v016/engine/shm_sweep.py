"""Reclaim shared-memory segments that dead runs left in ``/dev/shm``.

A SIGKILLed run (a preempted cluster job) cannot clean up: our capture ring
(``speculators-v016-ring-*``, normally unlinked as soon as the worker mapped
it) and what vLLM's multiprocess executor and Python's multiprocessing leave
(``psm_*`` ring buffers, ``sem.mp-*`` semaphores) stay until reboot. A
segment is removed only when it is this user's and **no live process maps it
or holds it open** (every readable ``/proc/<pid>/maps`` and ``/proc/<pid>/fd``
is checked); anything still in use, or another user's, is left alone.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from speculators_v016.engine.slot_ring import PREFIX, SHM_DIR

PATTERN = re.compile(rf"^({re.escape(PREFIX)}|psm_|sem\.mp-)")


@dataclass
class SweepResult:
    removed: list[str] = field(default_factory=list)
    bytes: int = 0


def _paths_in_use(shm_dir: str) -> set[str]:
    """Files under ``shm_dir`` that a live process maps or has open."""
    used: set[str] = set()
    prefix = shm_dir.rstrip("/") + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "maps", "rb") as fh:
                for line in fh:
                    at = line.find(prefix.encode())
                    if at >= 0:
                        used.add(line[at:].decode(errors="replace").rstrip("\n").removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target.removesuffix(" (deleted)"))
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue  # gone, or not ours to read
    return used


def stale_segments(shm_dir: str = SHM_DIR) -> list[Path]:
    """This user's segments of our kinds that no live process uses."""
    directory = Path(shm_dir)
    if not directory.is_dir():
        return []
    uid = os.getuid()
    candidates = []
    for entry in directory.iterdir():
        try:
            if PATTERN.match(entry.name) and entry.is_file() and entry.stat().st_uid == uid:
                candidates.append(entry)
        except FileNotFoundError:
            continue
    if not candidates:
        return []
    used = _paths_in_use(shm_dir)
    return [p for p in candidates if str(p) not in used]


def sweep(shm_dir: str = SHM_DIR) -> SweepResult:
    """Remove :func:`stale_segments`; return what was removed."""
    result = SweepResult()
    for path in stale_segments(shm_dir):
        try:
            size = path.stat().st_blocks * 512
            path.unlink()
        except FileNotFoundError:
            continue
        result.removed.append(path.name)
        result.bytes += size
    return result
