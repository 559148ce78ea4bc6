"""A file's bytes written with ``O_DIRECT``: from the callers' memory to the disk, past the page cache.

A buffered write copies every byte into the page cache (the kernel's copy,
half of a writer thread's CPU at hidden 7168), allocates and charges those
pages, and the sample writer then drops them again: all of it work on the
cores the engine uses, and the page allocator's locks it shares with the
engine's own page faults. With ``O_DIRECT`` the device reads the caller's
memory itself.

The kernel takes a direct write only where the memory address, the file
offset and the length are all multiples of the device's logical block
(512 B or 4 KiB: :data:`ALIGN` covers both). :class:`DirectSink` takes
buffers in file order and writes each stretch whose memory lies at the same
offset modulo :data:`ALIGN` as its bytes in the file straight from that
memory; everything else (a file's header, small tensors, the block where two
tensors meet, the last partial block) is gathered into an aligned bounce
buffer first. Memory laid out for it (``sample_format``'s layout,
``buffer_pool``'s placement) is written without a copy; any other memory is
written correctly through the bounce buffer, one user-space copy instead of
the kernel's. The last block is padded and the file cut to its size.

Where a file system refuses ``O_DIRECT``, :func:`enable` answers False (``fcntl``
said ``EINVAL``) or a write raises :class:`DirectRefused`; the caller then
writes the file through the page cache, as before.

A file system that keeps its files in memory (tmpfs, ramfs: :func:`in_memory`)
takes the flag since Linux 6.6, but there a direct write is the kernel's copy
into the file's pages all the same, made once the whole file is queued: the
hash read each chunk from memory first, and the copy reads it from memory again.
Written through the page cache, each chunk is copied and then hashed from the
core's cache: one read of the states' memory fewer (on an H100 host at hidden
7168, 0.85 against 0.86-0.90 CPU-s per GiB, the rate within noise;
``docs/benchmarks/README.md``). The sample writer therefore writes such
folders buffered.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import sys
import threading

import numpy as np

#: Memory, offset and length granule of a direct write: 4 KiB, a multiple of every common logical block size.
ALIGN = 4096
#: The bounce buffer: what is gathered before one write (a header and small tensors, or copied memory).
BOUNCE_BYTES = 1 << 20
#: Buffers queued for one ``pwritev`` at most (Linux's ``IOV_MAX`` is 1024).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)

_local = threading.local()
#: ``statfs(2)``'s ``f_type`` of the file systems whose files are their pages in memory.
IN_MEMORY = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


class DirectRefused(OSError):
    """The file system refused a direct write (``EINVAL``): the caller writes the file again, buffered."""


def address(view: memoryview) -> int:
    """The memory address of a byte view's first byte."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def enable(fd: int) -> bool:
    """Switch ``fd`` to direct writes; False where the file system refuses (the descriptor is left as it was)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    return True


def takes(folder) -> bool:
    """``folder``'s file system takes ``O_DIRECT`` (a probe file made, switched and removed)."""
    probe = os.path.join(folder, f".direct-probe.{os.getpid()}.{threading.get_native_id()}")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        return enable(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def in_memory(folder) -> str | None:
    """The name of ``folder``'s file system where it keeps its files in memory (:data:`IN_MEMORY`: tmpfs,
    ramfs), else None (a disk's, or not known: ``statfs`` failed, not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statfs(os.fsencode(os.fspath(folder)), buffer) != 0:
            return None
    except (OSError, AttributeError):
        return None
    kind = ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF  # __fsword_t; the magic numbers are 32-bit
    return IN_MEMORY.get(kind)


def disable(fd: int) -> None:
    """Back to buffered writes on ``fd``."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))


def _bounce() -> np.ndarray:
    """This thread's bounce buffer (page-aligned: an anonymous mapping), made once."""
    buffer = getattr(_local, "bounce", None)
    if buffer is None:
        _local.mapping = mmap.mmap(-1, BOUNCE_BYTES)
        buffer = _local.bounce = np.frombuffer(_local.mapping, dtype=np.uint8)
    return buffer


class DirectSink:
    """Writes buffers in file order to a descriptor opened for direct writes, from position 0.

    Aligned stretches of the callers' memory and the bounce buffer's gathered blocks are queued as they come and
    go out together in one ``pwritev``: a file is one write call, not one per tensor and joint (each call is a
    trip through the GIL for a writer thread, and beside a thread that runs Python each trip may wait a switch
    interval). The callers' buffers must stay as they are until :meth:`finish` (the sample writer's do: the
    sample is held until its file is durable). ``copied`` counts the bytes that went through the bounce buffer,
    ``direct`` those written from the callers' memory as it is.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.bounce = _bounce()
        self.base = 0  # file offset of the first queued byte (a multiple of ALIGN)
        self.fill = 0  # bytes of the bounce buffer in use: queued whole blocks, then the block being gathered
        self.start = 0  # bounce bytes before this are queued already (a multiple of ALIGN)
        self.queued: list[memoryview] = []  # whole blocks, in file order, not written yet
        self.direct = 0
        self.copied = 0

    def write(self, data) -> None:
        """Append ``data`` (any contiguous buffer) to the file."""
        view = memoryview(data).cast("B")
        start, size = 0, len(view)
        while start < size:
            rest = size - start
            if self.fill % ALIGN == 0 and rest >= ALIGN and address(view[start:]) % ALIGN == 0:
                self._queue_gathered()
                count = rest - rest % ALIGN
                self._queue(view[start : start + count])
                self.direct += count
                start += count
                continue
            room = ALIGN - self.fill % ALIGN if self.fill % ALIGN else len(self.bounce) - self.fill
            count = min(rest, room)
            np.copyto(self.bounce[self.fill : self.fill + count], np.frombuffer(view[start : start + count], np.uint8))
            self.fill += count
            self.copied += count
            start += count
            if self.fill == len(self.bounce):
                self._queue_gathered()
                self.flush()

    def finish(self) -> None:
        """Write what is queued and gathered (its last block padded with zeros) and cut the file to its size."""
        size = self.base + sum(len(v) for v in self.queued) + self.fill - self.start
        padded = -(-self.fill // ALIGN) * ALIGN
        self.bounce[self.fill : padded] = 0
        self.fill = padded
        self._queue_gathered()
        self.flush()
        if self.base != size:
            os.ftruncate(self.fd, size)

    def flush(self) -> None:
        """Write the queued blocks now (the block being gathered stays in the bounce buffer)."""
        while self.queued:
            try:
                done = os.pwritev(self.fd, self.queued, self.base)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise DirectRefused(exc.errno, "the file system refused a direct write") from exc
                raise
            if done <= 0 or done % ALIGN:
                raise DirectRefused(errno.EIO, f"a direct write wrote {done} bytes of {self._queued_bytes()}")
            self.base += done
            while done and done >= len(self.queued[0]):  # a direct write may also be short
                done -= len(self.queued.pop(0))
            if done:
                self.queued[0] = self.queued[0][done:]
        if self.start == self.fill:  # nothing gathered is waiting: the bounce buffer is free again
            self.start = self.fill = 0

    def _queue(self, view: memoryview) -> None:
        self.queued.append(view)
        if len(self.queued) >= _IOV_MAX:
            self.flush()

    def _queue_gathered(self) -> None:
        """Queue the bounce buffer's whole gathered blocks (``fill`` is at a block boundary)."""
        if self.fill > self.start:
            self._queue(memoryview(self.bounce)[self.start : self.fill])
            self.start = self.fill

    def _queued_bytes(self) -> int:
        return sum(len(v) for v in self.queued)
