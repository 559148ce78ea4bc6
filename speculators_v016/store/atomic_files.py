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


def drop_pages(fd: int) -> None:
    """Ask the kernel to drop a durable file's (clean) pages from the page cache; ignored where unsupported."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def write_parts(fh, parts: Sequence, digest) -> int:
    """Write ``parts`` in order to ``fh``, hashing on the way; return the bytes written.

    Both release the GIL for large buffers, so writers in several threads
    hash and write on several cores.
    """
    size = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view:  # an unbuffered file may write less than asked
            written = fh.write(view)
            view = view[written:]
        digest.update(part)
        size += len(part)
    return size


def write_durable(directory: Path, name: str, parts: bytes | Sequence, *, drop_cache: bool = False) -> tuple[int, str]:
    """Write ``parts`` (in order) to ``directory/name``: temporary name, fsync, rename; return (bytes, sha256 hex).

    The file's contents are on disk before it gets its final name, so the name
    never shows a partial file; the rename itself is durable once the folder is
    fsynced (:func:`fsync_dir`), which callers may do once for many files.
    ``drop_cache``: once on disk, the file's pages leave the page cache
    (``POSIX_FADV_DONTNEED``; advice only, never an error).
    """
    parts = [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, (bytes, bytearray)) else parts)]
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with tmp.open("wb", buffering=0) as fh:
            size = write_parts(fh, parts, digest)
            os.fsync(fh.fileno())
            if drop_cache:
                drop_pages(fh.fileno())
        os.replace(tmp, directory / name)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    return size, digest.hexdigest()


def write_atomic(directory: Path, name: str, parts: bytes | Sequence) -> tuple[int, str]:
    """:func:`write_durable`, then the folder fsynced: the new name is on disk too."""
    result = write_durable(directory, name, parts)
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    return result
