"""Group commit: sample files made durable and listed in batches, not one by one.

A writer fsyncs each sample file and renames it to its final name
(:func:`~speculators_v016.store.atomic_files.write_durable`), then hands its
manifest entry to :meth:`GroupCommit.add`. A committer thread takes every
entry waiting at once, fsyncs the folder (the renames are on disk), then
appends their lines with one write and one fsync
(:meth:`~speculators_v016.store.manifest.Manifest.append`). Commits start at
most every ``interval`` seconds, so under load a batch grows with the rate and
its two fsyncs are shared by all its samples; when the writers are idle an
entry is listed within ``interval``.

What a crash (SIGKILL, power loss) can leave, at any point: files complete
under their final names but not listed (a resume writes them again), a torn
last manifest line (ignored, and compacted away on resume), never a listed
file whose rename is not durable nor a partial file under a final name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from speculators_v016.store.atomic_files import WriteError, fsync_dir
from speculators_v016.store.manifest import Entry, Manifest
from speculators_v016.store.no_links import LinkedEntryError

#: Seconds between commits at most: under load every commit lists this long's samples.
DEFAULT_COMMIT_INTERVAL = 0.25


class GroupCommit:
    """A committer thread: entries of renamed files -> folder fsync -> manifest lines + fsync, per batch."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        *,
        interval: float = DEFAULT_COMMIT_INTERVAL,
        on_commit: Callable[[list[Entry]], None] | None = None,
    ):
        self.directory, self.manifest, self.interval = Path(directory), manifest, interval
        self.on_commit = on_commit
        self.error: BaseException | None = None
        self.commits = 0
        self._pending: list[Entry] = []
        self._closing = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sample-commit", daemon=True)
        self._thread.start()

    def add(self, entry: Entry) -> None:
        """An entry whose file is fsynced and renamed into place; listed at the next commit."""
        with self._wake:
            self._pending.append(entry)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._closing)
                batch, self._pending = self._pending, []
                if not batch and self._closing:
                    return
            started = time.monotonic()
            if self.error is None:
                try:
                    self._commit(batch)
                except BaseException as exc:  # noqa: BLE001 - handed to the writer's caller
                    self.error = exc
            with self._wake:  # the next batch gathers for at least `interval`, unless closing
                self._wake.wait_for(
                    lambda: self._closing, timeout=max(0.0, self.interval - (time.monotonic() - started))
                )

    def _commit(self, batch: list[Entry]) -> None:
        try:
            fsync_dir(self.directory)
            self.manifest.append(*batch)
        except LinkedEntryError:
            raise  # the manifest is a link or another file: the run stops naming it (the folder refused)
        except OSError as exc:
            raise WriteError(
                exc.errno, f"cannot record {len(batch)} sample(s) in {self.manifest.path}: {exc.strerror or exc}"
            ) from exc
        self.commits += 1
        if self.on_commit is not None:
            self.on_commit(batch)

    def close(self) -> None:
        """Commit what is waiting and stop the thread (the error, if any, stays in :attr:`error`)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
