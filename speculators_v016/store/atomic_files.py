"""Files that are either absent, old, or complete: temporary name, fsync, rename, fsync the folder.

Contents are given as a sequence of buffers (bytes, memoryviews of tensors)
and written as they are, hashed on the way (BLAKE3 or sha256:
:mod:`~speculators_v016.store.checksum`): each byte is hashed from the buffer
it is written from, no joined copy of the file is ever made, and the file is
never read back. A chunk may also be *scanned* while it is in the core's cache
(``scans``, e.g. the NaN/Inf check): a scan that refuses a chunk stops the write
and no file is left, under either name. With ``direct`` the bytes go to the disk
past the page cache where the file system allows it
(:mod:`~speculators_v016.store.direct_io`), the same bytes either way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from speculators_v016.store import checksum, direct_io, no_links
from speculators_v016.store.no_links import LinkedEntryError

TMP_PREFIX = ".tmp-"


class WriteError(OSError):
    """A file could not be written; the message names the path."""


class ChunkRefused(Exception):
    """A scan of :func:`write_parts` refused a chunk of ``part`` (its position in the parts): nothing is kept."""

    def __init__(self, part: int):
        super().__init__(f"part {part} refused by its scan")
        self.part = part


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
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


#: Bytes hashed and scanned (and queued for the write) at a time: the scans read what the hash just read, from the
#: cache. Whole tensors (up to 1 GiB a call) would take the GIL back fewer times, and beside a thread that runs
#: Python without pause one writer kept 0.35x of its pace alone against 0.14x in 4 MiB chunks
#: (docs/benchmarks/writer_gil.md), but each of their passes reads memory: 2 writers on a 2-core AVX2 EPYC spent
#: 1.30 against 1.13 CPU-s per GiB into /dev/shm and 0.80 against 0.75 to ext4 with ``O_DIRECT``
#: (tools/benchmarks/host_path.py's "whole tensors" row), and on the H200's host 8 writers at hidden 7168 in
#: 4 MiB chunks computed 86% of their busy time: there the cores, not the GIL, bound them. Not less than 4 MiB:
#: at 512 KiB they computed 70% of it (docs/benchmarks/gpu_generator.md).
WRITE_CHUNK = 1 << 22


def write_parts(fh, parts: Sequence, digest, scans: Sequence | None = None, sink=None) -> int:
    """Write ``parts`` in order to ``fh`` (or ``sink``, a :class:`~speculators_v016.store.direct_io.DirectSink`,
    whose caller finishes it), hashing on the way; return the bytes written.

    Each ``WRITE_CHUNK`` of a part is written (a sink only queues it), then
    hashed. Both release the GIL for large buffers, so writers in several
    threads hash and write on several cores. ``scans``: one callable or None
    per part; ``scan(chunk)`` is called on each chunk of its part just after
    its hash, from the cache, and a false result raises :class:`ChunkRefused`.
    """
    size = 0
    for position, part in enumerate(parts):
        view = memoryview(part).cast("B")
        scan = scans[position] if scans is not None else None
        for start in range(0, len(view), WRITE_CHUNK):
            chunk = rest = view[start : start + WRITE_CHUNK]
            if sink is not None:
                sink.write(chunk)
                rest = None
            while rest:  # an unbuffered file may write less than asked
                rest = rest[fh.write(rest) :]
            digest.update(chunk)
            if scan is not None and not scan(chunk):
                raise ChunkRefused(position)
        size += len(view)
    return size


def write_durable(
    directory: Path,
    name: str,
    parts: bytes | Sequence,
    *,
    drop_cache: bool = False,
    algorithm: str = checksum.DEFAULT,
    scans: Sequence | None = None,
    direct: dict | None = None,
) -> tuple[int, str]:
    """Write ``parts`` (in order) to ``directory/name``: temporary name, fsync, rename; return (bytes, hex digest).

    The digest is ``algorithm``'s (:mod:`~speculators_v016.store.checksum`) of
    exactly the bytes written.

    The file's contents are on disk before it gets its final name, so the name
    never shows a partial file; the rename itself is durable once the folder is
    fsynced (:func:`fsync_dir`), which callers may do once for many files. The
    temporary file is created exclusively and never through a link
    (:mod:`~speculators_v016.store.no_links`): a name someone else made there
    raises :class:`~speculators_v016.store.no_links.LinkedEntryError` and is
    left as it is.
    ``drop_cache``: once on disk, the file's pages leave the page cache
    (``POSIX_FADV_DONTNEED``; advice only, never an error). ``scans``: see
    :func:`write_parts`; a refused chunk raises :class:`ChunkRefused` and the
    temporary file is deleted, like the one of any write that fails.
    ``direct``: written with ``O_DIRECT`` (:mod:`~speculators_v016.store.direct_io`) where the file system
    takes it; where it refuses, at the start or at a write, the file is written again from its start, buffered.
    The dict counts the bytes: ``direct`` (from the parts' memory), ``bounced`` (through the bounce buffer),
    ``buffered`` (through the page cache); and ``refused``, the files whose direct write was refused.
    """
    parts = [memoryview(p).cast("B") for p in ([parts] if isinstance(parts, (bytes, bytearray)) else parts)]
    digest = checksum.new(algorithm)  # an unknown algorithm fails before any file is made
    tmp = directory / f"{TMP_PREFIX}{name}.{os.getpid()}"
    try:
        fh = open(tmp, "xb", buffering=0, opener=no_links.opener)  # noqa: SIM115 - closed below
    except LinkedEntryError:
        raise  # not ours: left as it is
    except OSError as exc:
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    try:
        with fh:
            size, digest = _write_file(fh, parts, digest, scans, direct, algorithm)
            os.fsync(fh.fileno())
            if drop_cache:
                drop_pages(fh.fileno())
        os.replace(tmp, directory / name)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, digest.hexdigest()


def _write_file(fh, parts: list, digest, scans, direct: dict | None, algorithm: str):
    """The file's bytes written, direct where asked and taken: (size, digest). Where a direct write is refused
    the file starts over, buffered, with a fresh digest."""
    fd = fh.fileno()
    if direct is not None and direct_io.enable(fd):
        sink = direct_io.DirectSink(fd)
        try:
            size = write_parts(fh, parts, digest, scans, sink=sink)
            sink.finish()  # the gathered tail, padded, and the file cut to its size
        except direct_io.DirectRefused:
            direct["refused"] = direct.get("refused", 0) + 1
            direct_io.disable(fd)
            os.ftruncate(fd, 0)
            fh.seek(0)
            digest = checksum.new(algorithm)
        else:
            direct["direct"] = direct.get("direct", 0) + sink.direct
            direct["bounced"] = direct.get("bounced", 0) + sink.copied
            return size, digest
    size = write_parts(fh, parts, digest, scans)
    if direct is not None:
        direct["buffered"] = direct.get("buffered", 0) + size
    return size, digest


def write_atomic(
    directory: Path, name: str, parts: bytes | Sequence, *, algorithm: str = checksum.DEFAULT
) -> tuple[int, str]:
    """:func:`write_durable`, then the folder fsynced: the new name is on disk too."""
    result = write_durable(directory, name, parts, algorithm=algorithm)
    try:
        fsync_dir(directory)
    except OSError as exc:
        raise WriteError(exc.errno, f"cannot write {directory / name}: {exc.strerror or exc}") from exc
    return result
