"""The output folder: ours alone, one writer at a time, no leftovers trusted.

A folder is accepted when it is new, empty, or holds only what a run of ours
writes; anything else is refused (we never write among unrelated files). A
run holds an exclusive ``flock`` on the folder itself (and on its lock file,
which holds its pid) for its whole life, so two runs can never write the same
folder, even where the lock file was deleted meanwhile. Temporary files left by a killed run
are removed when the next run takes the lock.

One ``--output-dir`` holds one layout: either one unsharded run, or the
``shard-K-of-N`` folders of one sharded run (and the shared ``logs``).
Upstream's trainer reads the folder recursively, so a second layout beside the
first would be mixed into training: :class:`ShardedRoot` refuses it, and takes a
shared lock on the root that an unsharded run's exclusive one excludes.

A folder that cannot be created or written is refused naming it: exit 4
(:class:`OutputDirError`: no permission, read-only), or 6 (:class:`WriteError`:
no space left).

A folder whose entries include symbolic links is refused too, naming them and
where they point (exit 4): a run never writes through a link
(:mod:`~speculators_v016.store.no_links`). The folder given as ``--output-dir``
is taken as the user names it (a link in that path is followed, as for any
path argument); a shard folder inside it is ours, and must not be a link.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
from pathlib import Path

from speculators_v016.shared.shm_records import RECORDS_PREFIX
from speculators_v016.store import no_links
from speculators_v016.store.atomic_files import TMP_PREFIX, WriteError
from speculators_v016.store.manifest import NAME as MANIFEST
from speculators_v016.store.sample_format import parse_sample_name

CONFIG = "data_config.json"
LOCK = ".speculators-data-gen.lock"
SHARD_DIR = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
LOGS = "logs"  # the CLI's log files (speculators_v016.run.console)
REGENERATED = ("regenerated.jsonl", "regenerated.journal.jsonl")  # a --regenerate run's text (store.regenerated)
OURS = {CONFIG, MANIFEST, LOCK, LOGS, *REGENERATED}
# the shared-memory records folder of runs with the multiprocess executor: in /dev/shm itself, so in an
# --output-dir of /dev/shm (speculators_v016.shared.shm_records); ours, never a sample or a run's file
SHM_RECORDS = re.compile(rf"^{re.escape(RECORDS_PREFIX)}\d+$")
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class OutputDirError(RuntimeError):
    """The output folder cannot be used; the message says why and what to do."""


#: a temporary file of ours: ``.tmp-NAME.PID`` (speculators_v016.store.atomic_files), NAME a file of ours
_OUR_TMP = re.compile(rf"^{re.escape(TMP_PREFIX)}(?P<name>.+)\.\d+$")


def is_our_tmp(name: str) -> bool:
    """Whether ``name`` is a temporary file this tool writes (and removes as an interrupted write's leftover): a
    user's ``.tmp-notes.txt`` is not, and is never deleted."""
    match = _OUR_TMP.match(name)
    return match is not None and (match["name"] in OURS or parse_sample_name(match["name"]) is not None)


def is_ours(name: str) -> bool:
    return (
        name in OURS or is_our_tmp(name) or parse_sample_name(name) is not None or SHM_RECORDS.match(name) is not None
    )


def _beside_any_run(name: str) -> bool:
    """Logs, the lock, shared-memory records: what may sit beside either layout."""
    return name in (LOGS, LOCK) or SHM_RECORDS.match(name) is not None


def unsharded_run_files(names) -> list[str]:
    """Of a folder's ``names``, those an unsharded run writes beside its samples (not logs, the lock, records)."""
    return sorted(n for n in names if is_ours(n) and not _beside_any_run(n))


def _summary(names: list[str]) -> str:
    return f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"


def cannot_use(path: Path, exc: OSError, what: str = "") -> OSError | OutputDirError:
    """The error of a folder or file of ours that cannot be made or written: WriteError when the disk is full
    (exit 6), OutputDirError otherwise (exit 4); both name ``path``."""
    reason = exc.strerror or str(exc)
    if exc.errno in _FULL:
        return WriteError(exc.errno, f"cannot write {path}: {reason}")
    return OutputDirError(
        f"--output-dir: cannot {what or 'create or write'} {path} ({reason}); choose a folder you can write"
    )


def _refuse_links(path: Path) -> None:
    """OutputDirError naming the entries of ``path`` that are symbolic links, where there are any."""
    links = no_links.links_in(path)
    if links:
        raise OutputDirError(
            f"--output-dir {path} holds symbolic links ({no_links.describe(path, links)}); a run writes only files "
            "it makes itself, never through a link: remove them (their targets are not touched), or use another "
            "folder"
        )


def _lock(path: Path, mode: int) -> tuple[int, int]:
    """The folder ``path`` and its lock file, open and held with ``mode`` (``fcntl.LOCK_EX``/``LOCK_SH``): the
    folder's own lock is what a deleted lock file cannot defeat (another run's lock on the same folder fails
    whatever became of the file; a filesystem that locks no folder, NFSv4, leaves the file's lock alone); the file
    holds the pid, for messages. The lock file is never opened through a link, and only as a regular file of one
    link (a hard link to another file would have its bytes replaced by our pid)."""
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise cannot_use(path, exc, "open") from None
    try:
        fcntl.flock(folder, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(folder)
        raise _in_use(path) from None
    except OSError:
        pass  # no folder locks here: the lock file's, as before
    try:
        fd = no_links.open_in_place(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except no_links.LinkedEntryError as exc:
        os.close(folder)
        raise OutputDirError(f"--output-dir: {exc.strerror}") from None
    except OSError as exc:
        os.close(folder)
        raise cannot_use(path / LOCK, exc) from None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        os.close(folder)
        raise _in_use(path) from None
    return folder, fd


def _in_use(path: Path) -> OutputDirError:
    """The folder is held by another run: the pid its lock file names, if any (never read through a link)."""
    try:
        fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        holder = "? (its lock file was deleted)"
    else:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
    who = f"run (pid {holder})" if holder else "sharded run"
    return OutputDirError(f"another speculators-data-gen {who} is writing to {path}; one run per folder")


def shard_name(index: int, count: int) -> str:
    """``shard-0000K-of-0000N``: the folder (and log-name suffix) of shard ``index`` of ``count``."""
    return f"shard-{index:05d}-of-{count:05d}"


def shard_dir(root: Path, index: int, count: int) -> Path:
    """Where shard ``index`` of ``count`` writes (the root itself when not sharded)."""
    return root if count == 1 else root / shard_name(index, count)


def shard_siblings(root: Path, index: int, count: int) -> list[Path]:
    """The other shard folders of a run split ``count`` ways in ``root`` (a link among them is refused by
    :class:`ShardedRoot`'s check, and :func:`speculators_v016.store.run_config.load` never reads through one)."""
    names = (SHARD_DIR.match(n) for n in os.listdir(root))
    return sorted(Path(root) / m.group(0) for m in names if m and int(m.group(2)) == count and int(m.group(1)) != index)


class OutputDir:
    """The folder one unsharded run or one shard writes. ``inside``: a folder of ours inside the user's
    ``--output-dir`` (a shard's), which must not itself be a link."""

    def __init__(self, path: Path, inside: bool = False):
        self.path = Path(path)
        self.inside = inside
        self._lock_fd: int | None = None
        self._folder_fd: int | None = None

    def _check_contents(self) -> None:
        if self.inside and self.path.is_symlink():
            raise OutputDirError(
                f"--output-dir: {self.path} is a symbolic link (-> {os.readlink(self.path)}), not the folder a "
                "run of ours made: never written through; remove it, or use another --output-dir"
            )
        _refuse_links(self.path)
        foreign = sorted(n for n in os.listdir(self.path) if not is_ours(n))
        shards = [n for n in foreign if SHARD_DIR.match(n)]
        if shards:
            raise OutputDirError(
                f"--output-dir {self.path} holds the shard folders of a sharded run ({_summary(shards)}); "
                "an unsharded run beside them would be mixed into training by a trainer reading the folder "
                "recursively: use another --output-dir, or the same --num-shards"
            )
        if foreign:
            raise OutputDirError(
                f"--output-dir {self.path} holds files this tool did not write ({_summary(foreign)}); "
                "use an empty or new folder"
            )

    def open(self) -> OutputDir:
        """Create or accept the folder, take the lock, clear temporary leftovers."""
        if self.path.exists() and not self.path.is_dir():
            raise OutputDirError(f"--output-dir {self.path} exists and is not a folder")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._check_contents()  # before the lock file: a refused folder is left as it was
        except OSError as exc:
            raise cannot_use(self.path, exc, "create or read") from None
        folder, fd = _lock(self.path, fcntl.LOCK_EX)
        try:
            self._check_contents()  # again, under the lock: a sharded run may have started meanwhile
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self.removed_leftovers = [n for n in os.listdir(self.path) if is_our_tmp(n)]
            for name in self.removed_leftovers:
                (self.path / name).unlink()
        except OSError as exc:
            os.close(fd)
            os.close(folder)
            raise cannot_use(self.path / LOCK, exc) from None
        except BaseException:
            os.close(fd)
            os.close(folder)
            raise
        self._lock_fd, self._folder_fd = fd, folder
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._folder_fd is not None:
            os.close(self._folder_fd)  # the folder's lock goes with its descriptor
            self._folder_fd = None

    def __enter__(self) -> OutputDir:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


class ShardedRoot:
    """The ``--output-dir`` of shard ``index`` of ``count``: holds shard folders of this count (and logs) only.

    Held with a shared lock for the shard's whole life: shards of one run share
    it, an unsharded run's exclusive lock on the same file excludes them.
    """

    def __init__(self, path: Path, count: int):
        self.path, self.count = Path(path), count
        self._lock_fd: int | None = None
        self._folder_fd: int | None = None

    def _check_contents(self) -> None:
        _refuse_links(self.path)  # a shard folder, logs or the lock as a link among them
        names = os.listdir(self.path)
        unsharded = unsharded_run_files(names)
        if unsharded:
            raise OutputDirError(
                f"--output-dir {self.path} holds an unsharded run ({_summary(unsharded)}); shard folders beside "
                "it would be mixed into training by a trainer reading the folder recursively: use another "
                "--output-dir"
            )
        others = sorted(n for n in names if SHARD_DIR.match(n) and int(SHARD_DIR.match(n).group(2)) != self.count)
        if others:
            raise OutputDirError(
                f"--output-dir {self.path} holds shard folders of a run split another way ({_summary(others)}); "
                f"this run is split {self.count} ways: use another --output-dir, or the same --num-shards"
            )
        foreign = sorted(n for n in names if not SHARD_DIR.match(n) and not _beside_any_run(n))
        if foreign:
            raise OutputDirError(
                f"--output-dir {self.path} holds files this tool did not write "
                f"({_summary(foreign)}); use an empty or new folder"
            )

    def open(self) -> ShardedRoot:
        if self.path.exists() and not self.path.is_dir():
            raise OutputDirError(f"--output-dir {self.path} exists and is not a folder")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._check_contents()
        except OSError as exc:
            raise cannot_use(self.path, exc, "create or read") from None
        folder, fd = _lock(self.path, fcntl.LOCK_SH)
        try:
            self._check_contents()
        except BaseException:
            os.close(fd)
            os.close(folder)
            raise
        self._lock_fd, self._folder_fd = fd, folder
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None

    def __enter__(self) -> ShardedRoot:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
