"""Sample files written atomically, by background workers behind a bounded queue.

Each file is written under a temporary name in the output folder, fsynced,
renamed to its final name (``data_{index}.{ext}``) and the folder fsynced
(:mod:`~speculators_v016.store.atomic_files`); only then is its manifest line
appended. Safetensors files are written straight from the tensors' memory. The queue between the engine and
the workers is bounded, so a slow disk slows generation instead of filling
memory. The first write error stops the run: :meth:`SampleWriter.put`
raises :class:`WriteError` naming the path.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from speculators_v016.store.atomic_files import WriteError, write_atomic
from speculators_v016.store.manifest import Entry, Manifest
from speculators_v016.store.sample_format import encode_parts, sample_name

class SampleWriter:
    """Workers that encode, write and record samples handed to :meth:`put`."""

    def __init__(self, directory: Path, fmt: str, layer_ids: list[int], *, workers: int = 2, bound: int = 8):
        self.directory, self.fmt, self.layer_ids = Path(directory), fmt, layer_ids
        self.manifest = Manifest(self.directory)
        self.queue: queue.Queue = queue.Queue(maxsize=bound)
        self.error: BaseException | None = None
        self.written = 0
        self.bytes = 0
        self._count_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"sample-writer-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            index, sample = job
            try:
                if self.error is None:
                    self._write(index, sample)
            except BaseException as exc:  # noqa: BLE001 - handed to the producer
                self.error = self.error or exc
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _write(self, index: int, sample: dict) -> None:
        name = sample_name(index, self.fmt)
        size, sha256 = write_atomic(self.directory, name, encode_parts(sample, self.fmt, self.layer_ids))
        self.manifest.append(Entry(index, name, size, sha256, int(sample["input_ids"].shape[0])))
        with self._count_lock:
            self.written += 1
            self.bytes += size

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            if isinstance(self.error, WriteError):
                raise self.error
            raise WriteError(f"writing samples to {self.directory} failed: {self.error!r}") from self.error

    def put(self, index: int, sample: dict) -> None:
        """Queue a sample (blocks while the queue is full); raise the first write error."""
        while True:
            self._raise_if_failed()
            try:
                self.queue.put((index, sample), timeout=0.5)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        """Wait for every queued sample; raise the first write error."""
        for _ in self._threads:
            self.queue.put(None)
        for thread in self._threads:
            thread.join()
        self._raise_if_failed()
