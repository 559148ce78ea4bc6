"""The serve folder: where a service publishes each sample's file, and its record of what it published.

A published sample is one file, ``online_{n}.safetensors`` (``n`` counts the
service's publications; nothing in a name comes from data), in the format of a
run's sample files (:mod:`~speculators_v016.store.sample_format`). It is written
under a temporary name and renamed, so a consumer never sees a partial file;
the consumer deletes it once read (or moves it into its cache). Not fsynced: a
published sample lives for seconds and a crash loses nothing a consumer cannot
ask for again.

Ownership by record, as the shared-memory rules have it: the service holds an
exclusive ``flock`` on the folder itself while it lives (its descriptor, opened
without following a link: what no deletion or replacement of a file defeats; a
second service's lock on the same folder fails whatever became of the lock file),
and appends a line to ``published.jsonl`` (file, bytes, the consumer that asked
for it) *before* the file gets its name. ``.speculators-serve.lock`` holds the
service's pid, for messages, and is locked too (as services before the folder's
own lock did). It is never opened through a symlink, and one that is not a regular
file of one link holding at most a pid is not ours: refused, untouched. Every
file it makes is created exclusively or opened without following a link
(:mod:`~speculators_v016.store.no_links`), and a folder holding links is refused. Once
locked, it must still be the file at its path (else it is taken again); the
running service looks every second: a lock file deleted is made again, one
replaced by another file stops the service, and so does the folder's path naming
another folder than the one locked (moved or replaced). The journal's first line
carries the name counter over and names this start of the service (``{"next": N,
"service": ID}``, ID also in ``/v1/info``: a consumer checks that the folder it
was given holds this service's journal): names are never reused, even after a start
that published nothing. The service deletes a published file only while that record
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
import stat
import uuid
from pathlib import Path

from loguru import logger

from speculators_v016.serve.publications import Publications
from speculators_v016.store import no_links
from speculators_v016.store.atomic_files import TMP_PREFIX, WriteError, write_atomic, write_parts
from speculators_v016.store.checksum import DEFAULT as DEFAULT_CHECKSUM
from speculators_v016.store.checksum import new as new_digest

LOCK = ".speculators-serve.lock"
JOURNAL = "published.jsonl"
_NAME = re.compile(r"^online_(\d+)\.safetensors$")
_TMP = re.compile(rf"^{re.escape(TMP_PREFIX)}online_\d+\.safetensors\.\d+$")


_PID_BYTES = 32  # a lock of ours holds a pid, or nothing


def _open_lock(path: Path, folder: Path) -> int:
    """Open (or create) the lock file: never through a symlink; refused where it is not a regular file of one
    link holding at most a pid (someone else's file: never truncated, never written)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:  # ELOOP: a symlink; ENXIO and others: a socket, a FIFO without a writer
        raise ServeDirError(f"--serve-dir {folder}: {LOCK} is not a regular file ({exc.strerror}); not ours") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ServeDirError(f"--serve-dir {folder}: {LOCK} is not a regular file; not ours")
        if st.st_nlink != 1:
            raise ServeDirError(f"--serve-dir {folder}: {LOCK} has {st.st_nlink} links (another file's); not ours")
        content = os.pread(fd, _PID_BYTES + 1, 0)
        if len(content) > _PID_BYTES or not content.strip().isdigit() and content.strip():
            raise ServeDirError(f"--serve-dir {folder}: {LOCK} holds something other than a pid; not ours")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_folder(path: Path) -> tuple[int, bool]:
    """The folder itself, open (never through a link), and whether it is exclusively locked: False where its
    filesystem locks no folder (NFSv4), the lock file's own lock then keeps others out. ServeDirError naming the
    service that holds it (its pid from the lock file, where that file is still there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ServeDirError(f"--serve-dir {path}: cannot open the folder ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ServeDirError(f"--serve-dir {path} is in use by a running service (pid {_holder(path)})") from None
    except OSError as exc:
        logger.warning(
            "--serve-dir {}: its filesystem locks no folder ({}): only the lock file {} keeps a second service out "
            "(a deleted lock file is made again within a second)",
            path,
            exc.strerror or exc,
            LOCK,
        )
        return fd, False
    return fd, True


def _holder(path: Path) -> str:
    """The pid the lock file names (``?`` where it is gone or unreadable), never through a link."""
    try:
        fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return "? (its lock file was deleted)"
    try:
        return os.pread(fd, _PID_BYTES, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Is ``path`` (not followed) the file open as ``fd``?"""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


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
        self._folder_fd: int | None = None  # the folder itself, open (and locked, where its filesystem can)
        self.folder_locked = False
        self._lock_fd: int | None = None
        self._journal = None
        self.identity = uuid.uuid4().hex  # this start of the service: the journal's first line and /v1/info name it

    def describe(self) -> dict:
        return {"kind": self.kind, "dir": str(self.path), "service": self.identity}

    # -- start and stop ----------------------------------------------------------------------------
    def open(self) -> ServeDir:
        """Take the folder: lock it, reclaim what a dead service's record names, refuse files that are not ours
        and links (the folder itself is taken as named: a link in ``--serve-dir``'s path is followed)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.path = Path(os.path.realpath(self.path))  # the folder, once: a link swapped later leads nowhere
        folder, self.folder_locked = _lock_folder(self.path)
        try:
            fd = self._lock()
        except BaseException:
            os.close(folder)
            raise
        try:
            self._take_over()
        except BaseException:
            os.close(fd)
            os.close(folder)
            raise
        self._write_pid(fd)
        self._lock_fd, self._folder_fd = fd, folder
        journal = no_links.open_in_place(self.path / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._journal = os.fdopen(journal, "a", encoding="utf-8")  # open while serving; never through a link
        return self

    def _lock(self) -> int:
        """The lock file, open and locked: never through a link, never a file that is not a lock of ours, and
        still the one at its path once locked (a lock deleted or replaced meanwhile is taken again)."""
        path = self.path / LOCK
        for _ in range(10):
            fd = _open_lock(path, self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, _PID_BYTES, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise ServeDirError(f"--serve-dir {self.path} is in use by a running service (pid {holder})") from None
            if _same_file(fd, path):
                return fd
            os.close(fd)  # deleted or replaced between open and lock: the one now at the path is the lock
        raise ServeDirError(f"--serve-dir {self.path}: its {LOCK} keeps being replaced; is another service starting?")

    @staticmethod
    def _write_pid(fd: int) -> None:
        os.ftruncate(fd, 0)  # a lock of ours (_open_lock checked): an empty file or a pid
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    def check_lock(self) -> str:
        """Is the lock at its path still the one this service holds? ``"held"``; ``"restored"`` where it was
        deleted (a new one is made and locked, so no other service takes the folder); ServeDirError where
        another file replaced it (another service may use the folder), or the folder's path names another folder
        than the one this service locked (moved or replaced)."""
        path = self.path / LOCK
        with self._cond:
            if self._folder_fd is not None and not _same_file(self._folder_fd, self.path):
                raise ServeDirError(
                    f"--serve-dir {self.path} is no longer the folder this service locked (moved or replaced while it "
                    "served): it publishes no more"
                )
            if self._lock_fd is None or _same_file(self._lock_fd, path):
                return "held"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                raise ServeDirError(
                    f"--serve-dir {self.path}: {LOCK} was replaced by another file while this service held it; "
                    "another service may be using the folder"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ServeDirError(f"--serve-dir {self.path}: {LOCK} was replaced and is locked by another") from None
            self._write_pid(fd)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = fd
            return "restored"

    def _take_over(self) -> None:
        links = no_links.links_in(self.path)
        if links:
            raise ServeDirError(
                f"--serve-dir {self.path} holds symbolic links ({no_links.describe(self.path, links)}); a service "
                "writes only files it makes itself, never through a link: remove them (their targets are not "
                "touched), or use another folder"
            )
        journal = self.path / JOURNAL
        named: set[str] = set()
        counted = (
            0  # the counter a journal carries over: names are never reused, even after a start that published none
        )
        if journal.is_symlink() or journal.exists() and not journal.is_file():
            raise ServeDirError(f"--serve-dir {self.path}: {JOURNAL} is not a regular file; not ours")
        if journal.exists():
            for line in no_links.read_bytes(journal).decode("utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn last line: its file was never renamed (the line comes first)
                if isinstance(record, dict) and isinstance(record.get("file"), str) and _NAME.match(record["file"]):
                    named.add(record["file"])
                elif isinstance(record, dict) and isinstance(record.get("next"), int):
                    counted = max(counted, record["next"])
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
        self._next = max(counted, max(numbers, default=-1) + 1)  # never reused: an old handle never reads a new file
        for name in names:
            if name in ours:
                try:
                    (self.path / name).unlink()
                    self.reclaimed.dead_service += name in named
                except FileNotFoundError:
                    pass  # its consumer took it meanwhile
        first = {"next": self._next, "service": self.identity}
        write_atomic(self.path, JOURNAL, (json.dumps(first) + "\n").encode())  # before any name is used

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
            if self._folder_fd is not None:
                os.close(self._folder_fd)  # the folder's lock goes with its descriptor
                self._folder_fd = None
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
            fh = open(tmp, "xb", buffering=0, opener=no_links.opener)  # noqa: SIM115 - exclusive, never via a link
        except no_links.LinkedEntryError:
            self._unreserve(nbytes)
            raise  # a name someone else made, named: left as it is
        except OSError as exc:
            self._unreserve(nbytes)
            raise WriteError(exc.errno or errno.EIO, f"cannot write {self.path / name}: {exc.strerror or exc}") from exc
        try:
            with fh:
                size = write_parts(fh, parts, digest)
            os.replace(tmp, self.path / name)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._unreserve(nbytes)
            raise WriteError(exc.errno or errno.EIO, f"cannot write {self.path / name}: {exc.strerror or exc}") from exc
        self._record(name, size, consumer)
        return {"backend": self.kind, "file": name, "bytes": size, self.checksum: digest.hexdigest()}

    def path_of(self, handle: dict) -> Path:
        return self.path / handle["file"]

    def _taken(self, names: list[str]) -> set[str]:
        return {n for n in names if not os.path.exists(self.path / n)}

    def _delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)
