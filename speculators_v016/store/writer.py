"""Sample files written by background workers behind a bounded queue, and committed in groups.

Each worker takes a sample, checks it (``reject``: a rejected sample is not
written and :meth:`SampleWriter.take_rejected` reports it), writes it under a
temporary name in the output folder straight from the tensors' memory, hashing
on the way (with ``O_DIRECT`` where the file system takes it: no copy into the
page cache, :mod:`~speculators_v016.store.direct_io`), fsyncs it and renames it
to its final name (``data_{index}.{ext}``, :func:`~speculators_v016.store.atomic_files.write_durable`).
:class:`~speculators_v016.store.group_commit.GroupCommit` then makes the
renames durable and appends the manifest lines, a batch at a time. With
``non_finite`` the writer refuses samples holding NaN/Inf states itself: each
float tensor is tested (:func:`~speculators_v016.checks.finite.bytes_finite`)
a chunk at a time right after the chunk is hashed, from the core's cache
(:data:`~speculators_v016.store.atomic_files.WRITE_CHUNK`); a refused
tensor deletes the temporary file, and
``non_finite(sample)`` names the bad layers for :meth:`SampleWriter.take_rejected`
(``.pt``: one pickled buffer, checked before the write). A sample
:meth:`SampleWriter.put` with ``finite=True`` (its states proven finite on
the device as they left it, ``StepCapture.finite``) skips that test: the
writers do not read its bytes for it. Once a
sample is written (or rejected, or dropped after an error) its ``done``
callback runs, e.g. to give its buffers back to a pool.

The digest (BLAKE3 by default, or sha256: ``checksum``,
:mod:`~speculators_v016.store.checksum`) and file writes release the GIL, so ``workers`` threads hash and write
on as many cores. They run ``nice`` levels below the process, so a contended
core goes to the engine first, and drop each file's pages from the page cache
once it is durable: a run writes far more than memory holds, and what the
cache would evict for it (model weights, the dataset) is worth more. The
queue between the engine and the workers is bounded, so a slow disk slows
generation instead of filling memory. The first write error stops the run:
:meth:`SampleWriter.put` raises :class:`WriteError` naming the path (or
:class:`~speculators_v016.store.no_links.LinkedEntryError`, where a name it
writes was found taken by a link or another file: never written through). Any other
failure on a writer thread (a ``reject`` or ``done`` callback raising, a bug)
stops it the same way, as :class:`WriterThreadError`: every exception of a
worker is caught and handed to the producer, and a producer waiting on a full
queue whose workers are all gone is told so, never left waiting.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from speculators_v016.checks import finite, finite_bits
from speculators_v016.config import DEFAULT_WRITE_WORKERS, WRITER_NICE_INCREMENT
from speculators_v016.store import checksum as checksums
from speculators_v016.store import direct_io
from speculators_v016.store.atomic_files import ChunkRefused, WriteError, write_durable
from speculators_v016.store.group_commit import DEFAULT_COMMIT_INTERVAL, GroupCommit
from speculators_v016.store.manifest import Entry, Manifest
from speculators_v016.store.no_links import LinkedEntryError
from speculators_v016.store.sample_format import encode_typed, sample_name
from speculators_v016.store.write_helper import INLINE_LIMIT, WriteHelper


class WriterThreadError(RuntimeError):
    """A writer thread failed for a reason other than a file that could not be written (a bug, said so)."""


def lower_this_thread(increment: int, batch: bool = False) -> bool:
    """Run the calling thread ``increment`` nice levels lower (Linux: per thread) and, with ``batch``, under
    ``SCHED_BATCH`` (its nice level kept): the scheduler then does not preempt the running thread for it the moment
    it wakes. Left as is where not allowed; returns whether the thread now runs under ``SCHED_BATCH``."""
    tid = threading.get_native_id()
    if increment > 0:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except (AttributeError, OSError):
            pass
    if batch:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread
            return True
        except (AttributeError, OSError):
            pass
    return False


class SampleWriter:
    """Workers that check, encode, write and (in groups) commit samples handed to :meth:`put`.

    ``cpus``: the CPUs the workers may run on (default: those of the thread that
    makes the writer). vLLM's CPU worker pins the thread it runs on to one core,
    and threads inherit that pin, so a writer made after a uniprocess engine
    started would otherwise hash and write on that one core. ``checksum``: the
    manifest's digest algorithm (a resumed folder's own, :mod:`~speculators_v016.store.checksum`).
    ``model_args``: the engine arguments that changed the model, named in each safetensors header.
    ``non_finite``: samples holding NaN/Inf are not written; it returns the
    reason :meth:`take_rejected` reports (None for a clean sample), and is
    called on such samples only (``.pt``: on every sample, before its write), never on those :meth:`put`
    with ``finite=True``.
    ``batch``: the workers run under ``SCHED_BATCH`` (:func:`lower_this_thread`); the CLI asks for it on a CPU
    engine, where a core a writer takes from one of the forward's two OpenMP threads stalls its partner at the
    next barrier too (measured faster there, docs/benchmarks/README.md, issue 53's writers section).
    ``direct``: files written with ``O_DIRECT`` where the file system takes it (False: through the page cache);
    a file system that takes the flag but refuses a direct write gets that file written again buffered, and
    every later file buffered (:attr:`refused` counts such files). A folder on tmpfs or ramfs is written
    buffered all the same (:attr:`in_memory` names it: there a direct write is the same copy, after the hash
    read the bytes from memory, :func:`~speculators_v016.store.direct_io.in_memory`).
    ``shared_blocks``: the buffer pool whose blocks are shared memory (``locate(address, length)``, ``live()``:
    :class:`~speculators_v016.engine.buffer_pool.BufferPool` with ``shared=True``); given, each worker hands the
    files whose states lie there to a helper process of its own (:mod:`~speculators_v016.store.write_helper`),
    started at its first such file, and waits for it without the GIL.
    ``screen``: the degenerate-row screen (:class:`~speculators_v016.checks.self_check.WriterScreen`), run on
    each layer's chunks as they are written and judged before the file is named; what it raises (a
    ``SelfCheckError``) stops the run as it is, and that sample's file is not kept.
    """

    def __init__(
        self,
        directory: Path,
        fmt: str,
        layer_ids: list[int],
        *,
        workers: int = DEFAULT_WRITE_WORKERS,
        bound: int = 8,
        reject: Callable[[dict], Any] | None = None,
        non_finite: Callable[[dict], Any] | None = None,
        screen=None,
        cpus: Iterable[int] | None = None,
        commit_interval: float = DEFAULT_COMMIT_INTERVAL,
        nice: int = WRITER_NICE_INCREMENT,
        batch: bool = False,
        checksum: str = checksums.DEFAULT,
        model_args: dict | None = None,
        direct: bool = True,
        shared_blocks=None,
    ):
        if workers < 1:
            raise ValueError(f"write workers must be at least 1, got {workers}")
        checksums.new(checksum)  # an unknown algorithm is refused here, not in a worker
        self.checksum = checksum
        self.directory, self.fmt, self.layer_ids = Path(directory), fmt, layer_ids
        self.model_args = model_args or {}
        self.manifest = Manifest(self.directory)
        self.queue: queue.Queue = queue.Queue(maxsize=bound)
        self.reject, self.non_finite, self.screen = reject, non_finite, screen
        self.cpus = set(cpus) if cpus else None
        self.nice, self.batch = nice, batch
        self.batched = 0  # writer threads (workers, then any drainers) that run under SCHED_BATCH
        self.error: BaseException | None = None
        self.written = 0  # samples committed (file durable, manifest line fsynced)
        self.bytes = 0
        self.waited = 0.0  # seconds :meth:`put` waited on a full queue (the producer held up by the writers)
        self.busy = 0.0  # thread-seconds the workers spent on samples (check, encode, hash, write, fsync)
        self.cpu = 0.0  # of which on a CPU (their threads' own CPU time): the rest is waiting (a core, the GIL)
        self.started = time.monotonic()
        # O_DIRECT where the file system takes it, not where its files are memory pages (store/direct_io.py)
        self.in_memory = direct_io.in_memory(self.directory) if direct else None
        self.direct = direct and self.in_memory is None
        self.paths = {"direct": 0, "bounced": 0, "buffered": 0}  # bytes by how they reached the file
        self.refused = 0  # files whose direct write the file system refused (after the first, no more are tried)
        self._rejected: list[tuple[int, Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.commit = GroupCommit(self.directory, self.manifest, interval=commit_interval, on_commit=self._count)
        self.shared_blocks = shared_blocks
        self.helped = 0  # files written by helper processes
        self.helper_cpu = 0.0  # their CPU seconds for those files (in :attr:`cpu` too)
        self.proven = 0  # samples put with finite=True: their NaN/Inf test was the device's, not the writers'
        self.tested = 0  # samples whose states the writers tested for NaN/Inf
        self.workers = workers
        self.drainers = 0  # threads :meth:`close` added for the samples still queued
        self._helpers: list[WriteHelper | None] = [None] * workers
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"sample-writer-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self.error = self.error or exc

    def _work(self, number: int) -> None:
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # this thread only
            if lower_this_thread(self.nice, self.batch):
                with self._lock:
                    self.batched += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the producer; the thread still drains the queue
            self._fail(exc)
        while (job := self.queue.get()) is not None:
            index, sample, done, finite = job
            began, began_cpu = time.monotonic(), time.thread_time()
            try:
                if self.error is None:
                    self._write(index, sample, number, finite)
            except BaseException as exc:  # noqa: BLE001 - handed to the producer
                self._fail(exc)
            with self._lock:
                self.busy += time.monotonic() - began
                self.cpu += time.thread_time() - began_cpu
            try:
                if done is not None:
                    done()
            except BaseException as exc:  # noqa: BLE001 - a failing callback stops the run, never this thread
                self._fail(exc)
            self.queue.task_done()
        self.queue.task_done()

    def _write(self, index: int, sample: dict, number: int = 0, finite: bool = False) -> None:
        reason = self.reject(sample) if self.reject is not None else None
        if not reason:
            parts, dtypes = encode_typed(sample, self.fmt, self.layer_ids, self.model_args)
            scans = None
            test = self.non_finite is not None and not finite  # proven on the device: not tested again here
            if test and dtypes is None:  # .pt: its bytes cannot be told apart
                reason = self.non_finite(sample)
            elif test:
                scans = [_finite_scan(dtype) for dtype in dtypes]
            if self.non_finite is not None:
                with self._lock:
                    self.tested, self.proven = self.tested + test, self.proven + (not test)
            if self.screen is not None and not reason:
                self.screen.check(index, sample)  # a finding stops the run before any file of it is made
        if reason:
            self._refuse(index, reason)
            return
        name = sample_name(index, self.fmt)
        paths: dict = {}
        try:
            shared = self._in_shared_blocks(parts, dtypes, scans)
            if shared is not None:
                size, digest = self._helped(number, name, *shared, paths)
            else:
                size, digest = write_durable(
                    self.directory,
                    name,
                    parts,
                    drop_cache=True,
                    algorithm=self.checksum,
                    scans=scans,
                    direct=paths if self.direct else None,
                )
        except ChunkRefused as refused:
            reason = self.non_finite(sample)
            if not reason:
                raise RuntimeError(
                    f"sample {index}: the check during the write found NaN/Inf in its part {refused.part}, "
                    "the check of the whole sample none"
                ) from refused
            self._refuse(index, reason)
            return
        with self._lock:
            if paths.pop("refused", 0):  # the file system took the flag, not the write: stop asking (one per run)
                self.direct, self.refused = False, self.refused + 1
            for path, count in (paths if paths else {"buffered": size}).items():
                self.paths[path] += count
        self.commit.add(Entry(index, name, size, digest, int(sample["input_ids"].shape[0]), self.checksum))

    def _in_shared_blocks(self, parts: list, dtypes, scans) -> tuple[list, list] | None:
        """The parts as a helper takes them, and the name of each one's float dtype for its NaN/Inf test; None where
        the thread writes the file itself: no shared blocks, states (a float tensor) outside them (a CPU engine's
        fresh memory), another part over :data:`INLINE_LIMIT`, a float type the helper's test has no table for."""
        if self.shared_blocks is None or dtypes is None:
            return None
        wire, names = [], []
        for part, dtype, scan in zip(parts, dtypes, scans or [None] * len(parts), strict=True):
            view = memoryview(part).cast("B")
            place = self.shared_blocks.locate(direct_io.address(view), len(view)) if len(view) else None
            if place is not None:
                wire.append(("block", *place, len(view)))
            elif (dtype is None or not dtype.is_floating_point) and len(view) <= INLINE_LIMIT:
                wire.append(("inline", view))  # the header, input_ids, loss_mask
            else:
                return None
            name = None if scan is None else str(dtype).removeprefix("torch.")
            if name is not None and name not in finite_bits.TESTS:
                return None
            names.append(name)
        return wire, names

    def start_helpers(self) -> None:
        """Start every worker's helper process now and wait until each is ready (imports done), rather than at
        each worker's first file in shared blocks: a GPU run's every file is (no-op without ``shared_blocks``).
        Called before the first :meth:`put`."""
        if self.shared_blocks is None:
            return
        for number, helper in enumerate(self._helpers):
            if helper is None:
                self._helpers[number] = WriteHelper(nice=self.nice, cpus=self.cpus)
        for helper in self._helpers:
            helper.wait_ready()

    def _helped(self, number: int, name: str, wire: list, names: list, paths: dict) -> tuple[int, str]:
        """Write one file through this worker's helper process (started on first use)."""
        helper = self._helpers[number]
        if helper is None:
            helper = self._helpers[number] = WriteHelper(nice=self.nice, cpus=self.cpus)
        before = helper.cpu
        size, digest, done = helper.write(
            self.directory, name, wire, names, self.checksum, self.direct, self.shared_blocks.live()
        )
        paths.update(done)
        with self._lock:
            self.cpu += helper.cpu - before
            self.helper_cpu += helper.cpu - before
            self.helped += 1
        return size, digest

    def _refuse(self, index: int, reason: Any) -> None:
        with self._lock:
            self._rejected.append((index, reason))

    def _count(self, batch: list[Entry]) -> None:
        with self._lock:
            self.written += len(batch)
            self.bytes += sum(e.bytes for e in batch)

    def load(self) -> dict:
        """What the host path did so far: ``workers``, ``busy`` (their share of the time since the writer was
        made), ``on_cpu`` (the share of that busy time their threads ran on a CPU: the rest they waited for a
        core or the GIL), ``cpu_per_gib`` (their CPU seconds per GiB committed), ``waited`` (s the producer
        waited on a full queue: the writers set the pace there), ``direct``, ``bounced``, ``buffered`` (the
        bytes written from the samples' memory with ``O_DIRECT``, through its bounce buffer, through the page
        cache), ``refused`` (files whose direct write the file system refused: later ones went buffered),
        ``in_memory`` (the folder's file system where its files are memory pages, written buffered: tmpfs,
        ramfs; else None), ``helped`` (files written by the workers' helper processes), ``drainers`` (threads
        :meth:`close` added for the last samples; ``busy`` is of ``workers`` alone), ``finite_proven`` /
        ``finite_tested`` (samples whose NaN/Inf test was the device's, put with ``finite=True``, / the writers'
        own), ``batched`` (writer threads, drainers included, running under ``SCHED_BATCH``)."""
        with self._lock:
            busy, cpu, written, paths = self.busy, self.cpu, self.bytes, dict(self.paths)
        span = max(time.monotonic() - self.started, 1e-9)
        return {
            "workers": self.workers,
            "drainers": self.drainers,
            "busy": busy / (span * self.workers),
            "on_cpu": cpu / busy if busy > 0 else 0.0,
            "cpu_per_gib": cpu / (written / 2**30) if written else 0.0,
            "waited": self.waited,
            "refused": self.refused,
            "in_memory": self.in_memory,
            "helped": self.helped,
            "finite_proven": self.proven,
            "finite_tested": self.tested,
            "batched": self.batched,
            **paths,
        }

    def take_rejected(self) -> list[tuple[int, Any]]:
        """Samples ``reject`` or the NaN/Inf check refused since the last call: ``(index, reason)``."""
        with self._lock:
            out, self._rejected = self._rejected, []
        return out

    def _raise_if_failed(self) -> None:
        error = self.error or self.commit.error
        if error is None and not self._closed and not any(t.is_alive() for t in self._threads):
            error = WriterThreadError("every sample-writer thread has ended")
        if error is None:
            return
        if isinstance(error, (WriteError, LinkedEntryError)) or self._screens(error):
            raise error
        if isinstance(error, OSError):
            raise WriteError(error.errno, f"writing samples to {self.directory} failed: {error}") from error
        raise WriterThreadError(
            f"a sample-writer thread failed ({type(error).__name__}: {error}); the run stops. Samples listed in "
            f"{self.manifest.path} are complete and kept; a resume writes the rest. Please report it with the log"
        ) from error

    def _screens(self, error: BaseException) -> bool:
        """``error`` is the screen's own finding (raised as it is, never as a writer bug)."""
        return self.screen is not None and isinstance(error, getattr(self.screen, "errors", ()))

    def _add_drainers(self, count: int) -> None:
        if self._closed or self.shared_blocks is not None or self.error is not None:
            return
        for _ in range(min(count, self.queue.qsize())):
            number = len(self._threads)
            self._helpers.append(None)
            thread = threading.Thread(target=self._work, args=(number,), name=f"sample-writer-{number}", daemon=True)
            self._threads.append(thread)
            self.drainers += 1
            thread.start()

    def put(self, index: int, sample: dict, done: Callable[[], None] | None = None, finite: bool = False) -> None:
        """Queue a sample (blocks while the queue is full); raise the first write error.

        ``done()`` runs once the writer no longer needs the sample's memory. ``finite``: its states were proven
        finite on the device, as they are (``StepCapture.finite``), so the writers skip their NaN/Inf test.
        """
        self._raise_if_failed()
        job = (index, sample, done, finite)
        try:
            self.queue.put_nowait(job)
            return
        except queue.Full:
            began = time.monotonic()
        try:
            while True:
                self._raise_if_failed()
                try:
                    self.queue.put(job, timeout=0.5)
                    return
                except queue.Full:
                    continue
        finally:
            self.waited += time.monotonic() - began

    def close(self, drain_workers: int = 0) -> None:
        """Wait for every queued sample and commit every written one; raise the first write error.

        ``drain_workers``: at most this many threads join the workers, one per sample still queued, for a caller
        that puts nothing more and whose other threads are done (the engine finished: its cores are free), so the
        last samples are not left to wait for a worker. Not with write helpers (a new thread's helper process
        would start first).
        """
        try:
            self._add_drainers(drain_workers)
            for _ in self._threads:
                while any(t.is_alive() for t in self._threads):
                    try:
                        self.queue.put(None, timeout=0.5)
                        break
                    except queue.Full:
                        continue
            for thread in self._threads:
                thread.join()
        finally:
            self._closed = True
            helpers = [h for h in self._helpers if h is not None]
            for helper in helpers:  # all told at once, then reaped: they exit together
                helper.end()
            for helper in helpers:
                helper.reap()
            self.commit.close()
        self._raise_if_failed()


def _finite_scan(dtype) -> Callable[[memoryview], bool] | None:
    """The NaN/Inf test of a part's chunks (None: the header, or integers)."""
    if dtype is None or not dtype.is_floating_point:
        return None
    return lambda chunk: finite.bytes_finite(chunk, dtype)
