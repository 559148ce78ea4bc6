"""Write helpers: processes that hash, test and write sample files from shared memory, each beside its own GIL.

A writer thread hashes, tests and writes a file in C calls that release the GIL, and takes it back between
them (a few times per 4 MiB chunk). On an H200 host at hidden 7168 (8.7 GiB/s of bf16 states) 8 threads
wrote 8.24 GiB/s on 8.4 cores and 12 or 16 threads no faster, on 8.6 cores (``tools/benchmarks/host_path.py``):
past 8 the threads waited for each other, not for the cores. A helper is a child process (this module's
:func:`main`, importing neither torch nor vLLM, from its parent's package folder) that does a writer thread's
heavy part for it: the thread sends the file's parts, the helper writes the file (:func:`~speculators_v016.store.atomic_files.write_durable`:
temporary name, the NaN/Inf test on each chunk, hash, fsync, rename; with ``O_DIRECT`` where the file
system takes it) and answers with its size and digest, and the thread waits on its socket without the GIL.

Memory. The states lie in the buffer pool's blocks, which are then memfd-backed shared memory
(:class:`~speculators_v016.engine.buffer_pool.BufferPool` with ``shared=True``): a part inside one is sent as
(block, offset, length), the block's descriptor with the first request that needs it (``SCM_RIGHTS``), and
the helper maps it once (read-only) and keeps it until told the pool dropped it. The header, ``input_ids``
and ``loss_mask`` (outside the blocks, up to :data:`INLINE_LIMIT` each) travel inline. A sample whose states lie
outside the blocks (a CPU engine's fresh memory) is written by the thread itself, as without helpers: from its
own memory, ``O_DIRECT`` where placed.

The wire format, both sides here: over a ``SOCK_SEQPACKET`` socket pair the helper greets once (:data:`HELLO`,
its imports done); then a request is one message of JSON
(``name``, ``directory``, ``algorithm``, ``direct``, ``scans``: a float dtype's name or null per part,
``parts``: ``["inline", length]`` or ``["block", id, offset, length]``, ``new``: ``[id, size]`` for each
descriptor attached, ``forget``: ids of blocks to unmap), then its inline bytes in messages of at most
:data:`INLINE_MESSAGE` bytes. The reply is one message of JSON: ``size``, ``digest``, ``paths`` (bytes by
how they reached the file, :mod:`~speculators_v016.store.direct_io`) and ``cpu`` (the helper's CPU seconds
for it, mapping new blocks included); or ``refused`` (the part a scan refused; no file is left); or ``error`` (``write``: a file that
could not be written, ``linked``: a name found taken, ``bug``: anything else) with ``errno`` and ``message``.
A helper ends when its socket closes: its writer closed it, or the parent process is gone (a file it was
writing then still completes under its final name, unlisted in the manifest, as a file whose manifest line
had not been committed when a run was killed: a resume writes that sample again).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from speculators_v016.store.atomic_files import ChunkRefused, WriteError
from speculators_v016.store.no_links import LinkedEntryError

#: Bytes of inline data a message carries (the header, ``input_ids``, ``loss_mask`` travel this way).
INLINE_MESSAGE = 1 << 16
#: A part outside the pool's shared blocks that is not a state (the header, ``input_ids``, ``loss_mask``) at
#: most this large travels inline; a larger one keeps the sample on its writer's thread.
INLINE_LIMIT = 4 << 20
#: Descriptors attached to one request at most (a sample's parts lie in one block: one is the usual count).
MAX_FDS = 16
#: Bytes of a request's or a reply's JSON at most.
MAX_JSON = 1 << 20
#: A helper's first message, once its imports are done.
HELLO = b"speculators-write-helper ready"
#: The folder this process imported ``speculators_v016`` from: a helper imports its code from there, never from
#: its working folder (``python -m`` would look there first: a checkout of another version the run was started
#: in would then write the files).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
#: A helper's program (``python -c``): argv ``[PACKAGE_ROOT, fd, settings]``; the first goes first on sys.path, the
#: working folder ('') off it.
LAUNCH = (
    "import sys; sys.path[:] = [sys.argv.pop(1)] + [p for p in sys.path if p]; "
    "from speculators_v016.store.write_helper import main; main(sys.argv[1:])"
)


class HelperGone(RuntimeError):
    """A write helper process ended while its writer still needed it (the message says how)."""


class WriteHelper:
    """One helper process and the writer thread's side of its socket (used by one thread at a time).

    ``nice``: nice levels the helper runs below this process; ``cpus``: the CPUs it may run on (None: this
    process's)."""

    def __init__(self, nice: int = 0, cpus=None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        settings = json.dumps({"nice": nice, "cpus": sorted(cpus) if cpus else None})
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", LAUNCH, PACKAGE_ROOT, str(theirs.fileno()), settings],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            theirs.close()
        self.sock = ours
        self.known: set[int] = set()  # blocks whose descriptor the helper holds
        self.cpu = 0.0  # the helper's CPU seconds over the files it wrote
        self.ready = False  # its greeting read: its imports are done

    def wait_ready(self) -> None:
        """Wait for the helper's greeting (sent once its imports are done)."""
        if self.ready:
            return
        try:
            hello = self.sock.recv(64)
        except OSError as exc:
            raise self._gone(f"its socket failed ({exc})") from exc
        if hello != HELLO:
            raise self._gone("it closed its socket" if not hello else f"it greeted with {hello[:64]!r}")
        self.ready = True

    def write(self, directory: Path, name: str, parts: list, scans: list, algorithm: str, direct: bool, blocks):
        """Write ``parts`` to ``directory/name`` through the helper; return ``(size, digest, paths)`` as
        :func:`~speculators_v016.store.atomic_files.write_durable` with ``direct`` would. ``parts``: for each,
        ``("inline", buffer)`` or ``("block", id, fd, block_size, offset, length)``; ``scans``: a float dtype's
        name (a key of :data:`~speculators_v016.checks.finite_bits.TESTS`) or None per part; ``blocks``: the ids of
        the blocks alive now (those the helper holds beyond them are forgotten). Raises as ``write_durable`` does
        (:class:`~speculators_v016.store.atomic_files.ChunkRefused`, ``WriteError``, ``LinkedEntryError``), and
        :class:`HelperGone` where the helper ended."""
        self.wait_ready()
        forget = sorted(self.known - set(blocks))
        self.known.difference_update(forget)
        wire, inline, new, fds = [], [], {}, []
        for part in parts:
            if part[0] == "inline":
                data = memoryview(part[1]).cast("B")
                wire.append(["inline", len(data)])
                inline.append(data)
                continue
            _, block, fd, size, offset, length = part
            if block not in self.known and block not in new:
                new[block] = size
                fds.append(fd)
            wire.append(["block", block, offset, length])
        request = {
            "name": name,
            "directory": str(directory),
            "algorithm": algorithm,
            "direct": bool(direct),
            "scans": scans,
            "parts": wire,
            "new": [[block, size] for block, size in new.items()],
            "forget": forget,
        }
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            for data in inline:
                for start in range(0, len(data), INLINE_MESSAGE):
                    self.sock.send(data[start : start + INLINE_MESSAGE])  # one message each, whole
            self.known.update(new)
            reply = self.sock.recv(MAX_JSON)
        except OSError as exc:
            raise self._gone(f"its socket failed ({exc})") from exc
        if not reply:
            raise self._gone("it closed its socket")
        answer = json.loads(reply)
        self.cpu += answer.get("cpu", 0.0)
        if "refused" in answer:
            raise ChunkRefused(answer["refused"])
        error = answer.get("error")
        if error == "write":
            raise WriteError(answer["errno"], answer["message"])
        if error == "linked":
            raise LinkedEntryError(answer["errno"], answer["message"])
        if error is not None:
            raise RuntimeError(f"the write helper (pid {self.process.pid}) failed: {answer['message']}")
        return answer["size"], answer["digest"], answer["paths"]

    def _gone(self, how: str) -> HelperGone:
        try:
            status = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            status = None
        said = "still running" if status is None else f"exit status {status}"
        return HelperGone(f"the write helper process (pid {self.process.pid}) is gone: {how}; {said}")

    def end(self) -> None:
        """Tell the helper to end: its socket closed, it exits once its current file is done."""
        self.sock.close()

    def close(self, timeout: float = 10.0) -> None:
        """End the helper and reap it."""
        self.end()
        self.reap(timeout)

    def reap(self, timeout: float = 10.0) -> None:
        """Wait for the helper's exit (its socket closed), killing it after ``timeout`` seconds."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- the helper's side ---------------------------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    """Answer requests until the socket closes."""
    from speculators_v016.checks import finite_bits  # noqa: PLC0415 - the helper's own imports, torch-free
    from speculators_v016.store.atomic_files import write_durable  # noqa: PLC0415

    blocks: dict[int, memoryview] = {}
    sock.send(HELLO)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_JSON, MAX_FDS)
        except ConnectionResetError:
            return
        if not message:
            return
        began = time.process_time()
        request = json.loads(message)
        for block in request["forget"]:
            blocks.pop(block).release()
        for (block, size), fd in zip(request["new"], fds, strict=True):
            try:
                region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   prot=mmap.PROT_READ)  # fmt: skip
            finally:
                os.close(fd)
            blocks[block] = memoryview(region)
        inline_bytes = sum(p[1] for p in request["parts"] if p[0] == "inline")
        inline = bytearray(inline_bytes)
        got = 0
        while got < inline_bytes:
            count = sock.recv_into(memoryview(inline)[got:], min(INLINE_MESSAGE, inline_bytes - got))
            if not count:
                return
            got += count
        parts, at = [], 0
        for part in request["parts"]:
            if part[0] == "inline":
                parts.append(memoryview(inline)[at : at + part[1]])
                at += part[1]
            else:
                _, block, offset, length = part
                parts.append(blocks[block][offset : offset + length])
        scans = [
            None if name is None else (lambda chunk, name=name: finite_bits.bytes_finite(chunk, name))
            for name in request["scans"]
        ]
        paths: dict = {}
        try:
            size, digest = write_durable(Path(request["directory"]), request["name"], parts, drop_cache=True,
                                         algorithm=request["algorithm"], scans=scans,
                                         direct=paths if request["direct"] else None)  # fmt: skip
            reply = {"size": size, "digest": digest, "paths": paths}
        except ChunkRefused as refused:
            reply = {"refused": refused.part}
        except LinkedEntryError as exc:
            reply = {"error": "linked", "errno": exc.errno, "message": exc.strerror or str(exc)}
        except WriteError as exc:
            reply = {"error": "write", "errno": exc.errno, "message": exc.strerror or str(exc)}
        except Exception as exc:  # noqa: BLE001 - told to the writer, which stops the run with it
            reply = {"error": "bug", "errno": None, "message": f"{type(exc).__name__}: {exc}"}
        reply["cpu"] = time.process_time() - began
        try:
            sock.send(json.dumps(reply).encode())
        except OSError:
            return


def main(argv: list[str]) -> None:
    settings = json.loads(argv[1])
    if settings.get("cpus"):
        os.sched_setaffinity(0, settings["cpus"])
    if settings.get("nice"):
        try:
            os.nice(settings["nice"])
        except OSError:
            pass
    with socket.socket(fileno=int(argv[0])) as sock:
        _serve(sock)
    os._exit(0)  # every file it wrote is closed and answered for: no interpreter teardown to wait for
