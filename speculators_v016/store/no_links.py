"""The entries of an output folder, never reached through a link.

An output folder (``--output-dir``, its shard folders, ``--serve-dir``) is ours alone, but anyone who can write
it, or a careless user, can leave a symbolic link in it: a ``manifest.jsonl`` pointing at a file elsewhere, a
``logs`` pointing at another folder, a link planted under the temporary name of a file a run is about to write.
Followed, each would make a run write outside its folder. So every file a run or a service makes in its folder
goes through here:

* a new file (the temporary name of every sample, ``data_config.json``, ``manifest.jsonl`` rewritten,
  ``regenerated.jsonl``, a log) is created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``,
  :func:`create_new`): a name that exists, a link included, is never opened;
* a file kept open in place (the manifest and the journals appended to, the lock) is opened with
  ``O_NOFOLLOW``, and only where it is a regular file of one link (:func:`open_in_place`): a hard link to a
  file elsewhere would be written through as well;
* a folder of ours inside (``logs``) is opened with ``O_DIRECTORY | O_NOFOLLOW`` relative to its parent's
  descriptor, and its files relative to its own (:func:`open_subfolder`);
* files of ours are read without following a link (:func:`read_bytes`).

Any of these meeting a link raises :class:`LinkedEntryError` naming the entry: the run stops (exit 4, the folder
refused), the link and its target untouched, what is already written kept. A folder that holds links when a run
takes it is refused before anything is written (:func:`links_in`, :func:`describe`).

The folder the user names is taken as named: a link in that path (``--output-dir /data/out`` where ``/data`` or
``out`` itself is a link) is followed, as for any path argument; the entries *inside* it are what never are.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

#: Flags every open of a file of ours carries.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class LinkedEntryError(OSError):
    """An entry of an output folder is a link, or a file this tool did not make where it makes one: never written
    through (the message names it). A run stops with exit 4 (the folder refused)."""


def links_in(directory: Path) -> list[str]:
    """The names of ``directory``'s entries that are symbolic links, sorted."""
    with os.scandir(directory) as entries:
        return sorted(e.name for e in entries if e.is_symlink())


def describe(directory: Path, names: list[str], limit: int = 5) -> str:
    """``name -> target`` for the first ``limit`` of ``names`` (links in ``directory``), then how many more."""
    shown = []
    for name in names[:limit]:
        try:
            shown.append(f"{name} -> {os.readlink(Path(directory) / name)}")
        except OSError:
            shown.append(name)
    return ", ".join(shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _refused(path: Path, why: str, code: int = errno.ELOOP) -> LinkedEntryError:
    return LinkedEntryError(
        code,
        f"{path}: {why}; a run writes only files it made itself in its folder, never through a link: the entry "
        "and what it points at are left as they are",
    )


def create_new(path: Path, mode: int = 0o666, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path``, open with ``flags`` (writing): never a name that exists, never through a link."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode)
    except FileExistsError:
        kind = "a symbolic link" if os.path.islink(path) else "a file"
        raise _refused(
            Path(path), f"{kind} someone else made under a name this run was creating", errno.EEXIST
        ) from None


def opener(path: str, flags: int) -> int:
    """Python's ``open(path, "xb", opener=opener)`` made by :func:`create_new` (the file object keeps its name)."""
    return create_new(Path(path), flags=flags)


def open_in_place(path: Path, flags: int, mode: int = 0o666) -> int:
    """``path`` opened with ``flags`` (``O_CREAT`` among them makes it where absent): never through a link, and only
    a regular file of one link; anything else raises :class:`LinkedEntryError` and is left as it is."""
    try:
        fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK, mode)  # non-blocking: a FIFO never holds the run
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(path, "a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, a socket
            raise _refused(path, "not a regular file", exc.errno) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(path, "not a regular file", errno.EINVAL)
        if info.st_nlink != 1:
            raise _refused(path, f"a file of {info.st_nlink} hard links (another file's too)", errno.EMLINK)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_to_read(path: Path):
    """The file at ``path`` open for reading (binary), never through a link (:class:`LinkedEntryError`), only a
    regular file; FileNotFoundError where there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(Path(path), "a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(Path(path), "not a regular file", errno.EINVAL)
    return os.fdopen(fd, "rb")


def read_bytes(path: Path) -> bytes:
    """The bytes of the file at ``path``, read as :func:`open_to_read` opens it."""
    with open_to_read(path) as fh:
        return fh.read()


def open_subfolder(parent: Path, name: str, mode: int = 0o777) -> int:
    """The folder ``parent/name`` (made where absent), open as a descriptor: ``parent`` as given, ``name`` never
    through a link (:class:`LinkedEntryError`)."""
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(name, mode, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(Path(parent) / name):
                raise _refused(Path(parent) / name, "a symbolic link") from None
            raise
    finally:
        os.close(parent_fd)
