"""The sha256 of input files, remembered by what the file system says of them, so an unchanged input is not
read again to be named.

A run names its inputs by content (the resume fingerprint, the prepared-rows cache's keys), so every run used to
read every input file through sha256, as large as the dataset however few rows a shard takes. Here a file's
digest is kept in the prepared-rows folder (:mod:`speculators_v016.store.prepared_cache`: an entry named by the
file's real path) beside its identity: ``(real path, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``. A
later run that finds the same identity takes the digest without reading the file.

Why that is sound: on a local file system any change to a file's bytes sets its ctime (status change time) to the
current time, and ctime cannot be set by a user (``touch``/``utime`` set the access and modification times, never
ctime; only the clock's owner could forge it); a file replaced by another (a rename, a copy) has another inode.
One gap remains, the one git calls *racily clean*: a write in the same clock tick as the stat that read the
identity leaves ctime unchanged. A digest is therefore only kept where the file's ctime is at least
:data:`SETTLE_NS` older than the moment it was hashed, and the stat before and after hashing agree; else the
file is hashed every run until it settles. What is kept is checked as every cache entry is (its size and
sha256); a damaged one is hashed again. Network file systems whose ctime is not kept by the server (some FUSE
mounts) are outside this guarantee: use ``--no-prepared-cache`` there, which hashes every input every run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from loguru import logger

from speculators_v016.store import prepared_cache
from speculators_v016.store.run_config import file_sha256

#: what an entry is, in its name: another version's entries are other entries
VERSION = "digest-memo-1"
#: how old a file's last change must be for its digest to be kept (the file system's clock tick, with margin)
SETTLE_NS = 2_000_000_000


def identity(path: str | Path) -> list:
    """``[real path, st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns]`` of ``path`` (links followed)."""
    real = os.path.realpath(path)
    info = os.stat(real)
    return [real, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


class NotRemembered(LookupError):
    """A digest asked for with ``remembered_only`` set that would have to be read (the file's path says it)."""


class DigestMemo:
    """sha256 of files, remembered in ``folder`` (None: every file hashed, nothing kept); ``hashed``: the files
    this memo read through (a test's and the benchmark's count); ``remembered_only``: a digest not remembered
    raises :class:`NotRemembered` instead of reading the file (a caller that would rather hash it meanwhile)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.hashed = 0
        self.remembered_only = False
        self._known: dict[tuple, str] = {}

    def sha256(self, path: str | Path) -> str:
        before = identity(path)
        key = tuple(before)
        if key in self._known:
            return self._known[key]
        name = prepared_cache.entry_name(VERSION, before[0])
        if self.folder is not None:
            found = self._read(name)
            if found is not None and found.get("identity") == before and isinstance(found.get("sha256"), str):
                self._known[key] = found["sha256"]
                return found["sha256"]
        if self.remembered_only:
            raise NotRemembered(before[0])
        started = time.time_ns()
        digest = file_sha256(before[0])
        self.hashed += 1
        if identity(path) == before:
            self._known[key] = digest
            if self.folder is not None and before[5] <= started - SETTLE_NS:
                self._write(name, {"identity": before, "sha256": digest})
        return digest

    def _read(self, name: str) -> dict | None:
        try:
            found = prepared_cache.read_entry(self.folder, name)
        except (prepared_cache.CorruptEntry, OSError) as exc:
            logger.warning("{}; the file is hashed again", exc)
            return None
        return None if found is None else found[1]

    def _write(self, name: str, facts: dict) -> None:
        try:
            prepared_cache.write_entry(self.folder, name, {}, facts)
        except OSError as exc:  # a digest not kept costs a read next time, never the run
            logger.warning("cannot keep an input's digest in {} ({})", self.folder, exc)
