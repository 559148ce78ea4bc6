"""Files that are either absent, old, or complete: temporary name, fsync, rename, fsync the folder.

Contents are given as a sequence of buffers (bytes, memoryviews of tensors)
and written as they are, hashed on the way: no joined copy of the file is
ever made.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from speculators_v016 import faults

TMP_PREFIX = ".tmp-"


class WriteError(OSError):
    """A file could not be written; the message names the path."""


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, name: str, parts: bytes | Sequence, sample: bool = False) -> tuple[int, str]:
    """Write ``parts`` (in order) to ``directory/name`` atomically; return (bytes, sha256 hex)."""
    parts = [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, (bytes, bytearray)) else parts)]
    if len(parts) == 1:  # a crash mid-write leaves half a file, whatever the shape of the contents
        half = len(parts[0]) // 2
        parts = [parts[0][:half], parts[0][half:]]
    first = (len(parts) + 1) // 2
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
    digest, size = hashlib.sha256(), 0
    try:
        with tmp.open("wb") as fh:
            for number, part in enumerate(parts):
                if number == first and sample:  # fault points of the fault-injection tests
                    faults.hit("kill-mid-write")
                    faults.hit("enospc-write", str(tmp))
                fh.write(part)
                digest.update(part)
                size += len(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, directory / name)
        fsync_dir(directory)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    return size, digest.hexdigest()
