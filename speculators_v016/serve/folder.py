"""The serve folder: where a service publishes each sample's file, and its record of what it published.

A published sample is one file, ``online_{n}.safetensors`` (``n`` counts the
service's publications; nothing in a name comes from data), in the format of a
run's sample files (:mod:`~speculators_v016.store.sample_format`). It is written
under a temporary name and renamed, so a consumer never sees a partial file;
the consumer deletes it once read (or moves it into its cache). Not fsynced: a
published sample lives for seconds and a crash loses nothing a consumer cannot
ask for again.

Ownership by record, as the shared-memory rules have it: the service holds an
exclusive lock on ``.speculators-serve.lock`` while it lives, and appends a line
to ``published.jsonl`` (file, bytes, the consumer that asked for it) *before* the
file gets its name. The service deletes a published file only while that record
says it is its own and not yet taken, and only when:

* its consumer is dead: a process on this host (by pid and start time, so a
  reused pid is not taken for it) that no longer runs;
* its lease ran out (``lease_seconds``): a consumer elsewhere that never took it;
* at start, the journal left by a dead service (its lock free) names it.

A file of our naming that no record names is not ours to delete: the folder is
refused. The cap on bytes not yet taken and the reclaiming rules are
:mod:`~speculators_v016.serve.publications`'.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
from pathlib import Path

from speculators_v016.serve.publications import Publications
from speculators_v016.store.atomic_files import TMP_PREFIX, WriteError, write_atomic, write_parts
from speculators_v016.store.checksum import DEFAULT as DEFAULT_CHECKSUM
from speculators_v016.store.checksum import new as new_digest

LOCK = ".speculators-serve.lock"
JOURNAL = "published.jsonl"
_NAME = re.compile(r"^online_(\d+)\.safetensors$")
_TMP = re.compile(rf"^{re.escape(TMP_PREFIX)}online_\d+\.safetensors\.\d+$")


def _target(tmp_name: str) -> str:
    """The final name a temporary file of ours was written for (``.tmp-online_N.safetensors.PID``)."""
    return tmp_name.removeprefix(TMP_PREFIX).rsplit(".", 1)[0]


class ServeDirError(RuntimeError):
    """The serve folder cannot be used (held by a live service, files that are not ours); the message says which."""


class ServeDir(Publications):
    """The folder a service publishes to: its lock, its record, the cap on bytes not yet taken."""

    kind = "folder"

    def __init__(self, path: Path, max_bytes: int, lease_seconds: float, checksum: str = DEFAULT_CHECKSUM):
        super().__init__(max_bytes, lease_seconds)
        self.path = Path(path)
        self.checksum = checksum
        self._next = 0
        self._lock_fd: int | None = None
        self._journal = None

    def describe(self) -> dict:
        return {"kind": self.kind, "dir": str(self.path.resolve())}

    # -- start and stop ----------------------------------------------------------------------------
    def open(self) -> ServeDir:
        """Take the folder: lock it, reclaim what a dead service's record names, refuse files that are not ours."""
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ServeDirError(f"--serve-dir {self.path} is in use by a running service (pid {holder})") from None
        try:
            self._take_over()
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        self._journal = open(self.path / JOURNAL, "a", encoding="utf-8")  # noqa: SIM115 - open while serving
        return self

    def _take_over(self) -> None:
        journal = self.path / JOURNAL
        named: set[str] = set()
        if journal.exists():
            for line in journal.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn last line: its file was never renamed (the line comes first)
                if isinstance(record, dict) and isinstance(record.get("file"), str) and _NAME.match(record["file"]):
                    named.add(record["file"])
        names = os.listdir(self.path)
        ours = named | {n for n in names if _TMP.match(n) and _target(n) in named}  # a temporary file: its line first
        foreign = sorted(n for n in names if n not in (LOCK, JOURNAL) and n not in ours)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ServeDirError(
                f"--serve-dir {self.path} holds files no record of ours names ({shown}); "
                "use an empty folder or one only a service of ours used"
            )
        numbers = [int(_NAME.match(n).group(1)) for n in named]
        self._next = max(numbers, default=-1) + 1  # names are never reused: an old handle never reads a new file
        for name in names:
            if name in ours:
                try:
                    (self.path / name).unlink()
                    self.reclaimed.dead_service += name in named
                except FileNotFoundError:
                    pass  # its consumer took it meanwhile
        write_atomic(self.path, JOURNAL, b"")

    def close(self) -> None:
        """Stop serving from the folder: the record and what is not yet taken stay (the next service reclaims them)."""
        with self._cond:
            if self._journal is not None:
                self._journal.close()
                self._journal = None
            if self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = None
            self._cond.notify_all()

    # -- publishing --------------------------------------------------------------------------------
    def publish(self, parts: list, nbytes: int, consumer: dict | None) -> dict:
        """Write one object's file (``parts``: its buffers, ``nbytes`` reserved); return its handle."""
        with self._cond:
            if self._journal is None:
                self._reserved -= nbytes
                raise RuntimeError("the service is stopping")
            name = f"online_{self._next}.safetensors"
            self._next += 1
            self._journal.write(json.dumps({"file": name, "bytes": nbytes, "consumer": consumer}) + "\n")
            self._journal.flush()  # the record before the name
        tmp = self.path / f"{TMP_PREFIX}{name}.{os.getpid()}"
        digest = new_digest(self.checksum)
        try:
            with tmp.open("wb", buffering=0) as fh:
                size = write_parts(fh, parts, digest)
            os.replace(tmp, self.path / name)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._unreserve(nbytes)
            raise WriteError(exc.errno or errno.EIO, f"cannot write {self.path / name}: {exc.strerror or exc}") from exc
        self._record(name, size, consumer)
        return {"backend": self.kind, "file": name, "bytes": size, self.checksum: digest.hexdigest()}

    def path_of(self, handle: dict) -> Path:
        return self.path.resolve() / handle["file"]

    def _taken(self, names: list[str]) -> set[str]:
        return {n for n in names if not os.path.exists(self.path / n)}

    def _delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)
