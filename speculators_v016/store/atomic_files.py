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

TMP_PREFIX = ".tmp-"


class WriteError(OSError):
    """A file could not be written; the message names the path."""


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_parts(fh, parts: Sequence, digest) -> int:
    """Write ``parts`` in order to ``fh``, hashing on the way; return the bytes written."""
    size = 0
    for part in parts:
        fh.write(part)
        digest.update(part)
        size += len(part)
    return size


def write_atomic(directory: Path, name: str, parts: bytes | Sequence) -> tuple[int, str]:
    """Write ``parts`` (in order) to ``directory/name`` atomically; return (bytes, sha256 hex)."""
    parts = [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, (bytes, bytearray)) else parts)]
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as fh:
            size = write_parts(fh, parts, digest)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, directory / name)
        fsync_dir(directory)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    return size, digest.hexdigest()
