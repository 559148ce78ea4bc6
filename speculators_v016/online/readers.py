"""How a consumer gets the file of a handle: from the serve folder, or out of the Mooncake store.

Either way the dataset gets a local file that upstream's reader opens, and removes it once read
(the served file itself, or the private copy of a Mooncake object). A Mooncake object is removed
from the store as soon as it is copied out: taken, as a deleted file is.

A handle is the producer's word, and the producer may be wrong or impersonated: nothing in it is
trusted (:func:`check_handle`), nor is the folder its ``/v1/info`` names: the folder is the
consumer's own setting (``folder=``, or the service's variable :data:`SERVE_DIR_VARIABLE`), checked
against the producer's at start (:func:`folder_reader`: the folder given must hold the journal of the
very start of the service the producer names, or, from a producer that names none, be the folder it
names, by device and inode). The consumer touches only a plain name of the service's own naming
(``online_N.safetensors``; ``speculators/HOST/PID-START/online_N`` in the store) inside the folder
(or store) it was configured with: never an absolute path, never ``..``, never a name with a
folder in it. A served file is opened without following a link (``O_NOFOLLOW``), must be a regular
file of the handle's size and digest (the digest the service computed as it wrote it, BLAKE3 or
sha256 as the handle names it) and a safetensors file whose header and data end where the file
ends; only then is it read, and it is deleted (or moved into the cache) only while its name still
holds that very file (same device and inode); an item whose file was replaced while upstream's
reader read it (by someone who can write the folder itself) is not used. Anything else is a :class:`ProducerError` naming the
sample, the service and what is wrong; a short or altered file is asked for again once (a retry can
help there), a handle that names something outside the folder is not.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from speculators_v016.online.client import ProducerError
from speculators_v016.serve.mooncake import local_address_towards, local_buffer_for
from speculators_v016.store.checksum import ALGORITHMS
from speculators_v016.store.checksum import new as new_digest

SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: The serve folder as this host sees it, where ``folder=`` is not given: the service's own ``--serve-dir`` variable.
SERVE_DIR_VARIABLE = "SPECULATORS_DATA_GEN_SERVE_SERVE_DIR"
JOURNAL = "published.jsonl"  # the service's record (speculators_v016.serve.folder): its first line names the service
#: the names a service publishes (speculators_v016.serve.folder): a counter, nothing from data
FILE_NAME = re.compile(r"^online_\d{1,18}\.safetensors$")
#: the keys a service puts into the Mooncake store (speculators_v016.serve.mooncake)
STORE_KEY = re.compile(r"^speculators/[A-Za-z0-9._-]{1,255}/\d{1,10}-\d{1,20}/online_\d{1,18}$")
_HEADER_MAX = 100 << 20  # safetensors' own bound on a header
_BLOCK = 16 << 20


class HandleError(ProducerError):
    """A handle that names something this consumer must not touch, or lacks a field: asking again will not help."""


class StaleFile(ProducerError):
    """The served file is not what the handle says (short, altered, not safetensors): asking again may help."""


def check_handle(handle, needs: str) -> tuple[str, int, str, str]:
    """``(name, bytes, algorithm, digest)`` of a handle, or HandleError saying what is wrong with it.

    ``needs``: the field naming the object (``file`` or ``key``); its value is matched by the caller."""
    if not isinstance(handle, dict):
        raise HandleError(f"the reply's handle is {type(handle).__name__}, not an object")
    name = handle.get(needs)
    if not isinstance(name, str):
        raise HandleError(f"the reply's handle has no {needs!r} (fields: {sorted(handle)[:8]})")
    size = handle.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 8:
        raise HandleError(f"the reply's handle gives bytes {size!r}, not a file size")
    found = [a for a in ALGORITHMS if a in handle]
    if not found or not isinstance(handle[found[0]], str) or not re.fullmatch(r"[0-9a-f]{64}", handle[found[0]]):
        raise HandleError(f"the reply's handle carries no digest ({' or '.join(ALGORITHMS)}, 64 hex digits)")
    return name, size, found[0], handle[found[0]]


def check_safetensors_frame(head: bytes, size: int) -> None:
    """The file's first bytes: a safetensors header whose tensors end exactly where the file ends."""
    if len(head) < 8:
        raise StaleFile(f"{size} bytes: too short for a safetensors file")
    (length,) = struct.unpack("<Q", head[:8])
    if not 0 < length <= min(_HEADER_MAX, size - 8) or len(head) < 8 + length:
        raise StaleFile(f"not a safetensors file (header of {length} bytes in a file of {size})")
    try:
        header = json.loads(head[8 : 8 + length])
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise StaleFile(f"not a safetensors file (its header does not parse: {type(exc).__name__})") from None
    if max(ends, default=0) != size - 8 - length:
        raise StaleFile(f"a safetensors file whose tensors end at {max(ends, default=0)} of {size - 8 - length} bytes")


@dataclass
class Taken:
    """A fetched sample: ``path`` is what upstream's reader opens; :meth:`release` removes what was served."""

    path: Path
    identity: tuple[int, int] | None = None  # (device, inode) of a served file; None: a private copy of ours

    def unchanged(self) -> bool:
        """Does the name still hold the file that was checked (a private copy: always)?"""
        if self.identity is None:
            return True
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) == self.identity

    def release(self) -> None:
        """Taken: the served file deleted (only while its name still holds the file that was checked)."""
        if self.identity is None:
            self.path.unlink(missing_ok=True)
        else:
            remove_if_same(self.path, self.identity)


def remove_if_same(path: Path, identity: tuple[int, int]) -> None:
    """Delete ``path`` if it still is the regular file ``identity`` names (never through a link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(info.st_mode) and (info.st_dev, info.st_ino) == identity:
        path.unlink(missing_ok=True)


class FolderReader:
    """Files in the service's ``--serve-dir``, seen here at ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def fetch(self, handle: dict) -> Taken | None:
        """The served file, checked; None where it is gone (reclaimed before it was read)."""
        name, size, algorithm, digest = check_handle(handle, "file")
        if not FILE_NAME.match(name):
            raise HandleError(
                f"the reply names the file {name[:200]!r}, not a plain name of the service's folder "
                "(online_N.safetensors): refused, nothing read or deleted"
            )
        path = self.folder / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise HandleError(f"{path} is a symbolic link, not a file the service wrote: not followed") from None
            raise StaleFile(f"{path} cannot be opened ({exc.strerror or exc})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise HandleError(f"{path} is not a regular file: not read")
            if info.st_size != size:
                raise StaleFile(f"{path} has {info.st_size} bytes, the reply says {size}")
            check_safetensors_frame(os.pread(fd, min(size, 8 + _HEADER_MAX, 1 << 20), 0), size)
            if _digest_of(fd, size, algorithm) != digest:
                raise StaleFile(f"{path}: its {algorithm} differs from the reply's (altered or torn)")
        finally:
            os.close(fd)
        return Taken(path, (info.st_dev, info.st_ino))

    def keep(self, taken: Taken, kept: Path) -> Path:
        """Move a served file into the cache as ``kept`` (copied where the cache is on another filesystem)."""
        info = os.lstat(taken.path)
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != taken.identity:
            raise StaleFile(f"{taken.path} was replaced after it was checked: not kept")
        try:
            os.replace(taken.path, kept)
        except OSError:  # another filesystem: copy what was checked, then the served file is taken
            fd = os.open(taken.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as src:
                info = os.fstat(fd)
                if (info.st_dev, info.st_ino) != taken.identity:
                    raise StaleFile(f"{taken.path} was replaced after it was checked: not kept") from None
                with open(kept.with_suffix(".part"), "wb") as dst:
                    shutil.copyfileobj(src, dst, _BLOCK)
            os.replace(kept.with_suffix(".part"), kept)
            taken.release()
        return kept

    def where(self, handle: dict) -> str:
        return (
            f"{handle['file']} is not in {self.folder}: is its --serve-dir seen here under another path (folder=...)?"
        )


def _digest_of(fd: int, size: int, algorithm: str) -> str:
    """The digest of the first ``size`` bytes of ``fd`` (no more are read, whatever the file does meanwhile)."""
    digest = new_digest(algorithm)
    buffer = bytearray(min(_BLOCK, size))
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        count = os.preadv(fd, [view[: min(len(buffer), size - offset)]], offset)
        if not count:
            break
        digest.update(view[:count])
        offset += count
    return digest.hexdigest()


class MooncakeReader:
    """Objects of the service's Mooncake store; one store client per process (DataLoader workers fork)."""

    def __init__(self, master: str, max_object_bytes: int):
        self.master, self.buffer = master, local_buffer_for(int(max_object_bytes))
        self._store, self._pid = None, None
        self._lock = threading.Lock()  # one client per process, used by one thread at a time

    def _client(self):
        if self._pid != os.getpid():  # forked: a client of this process's own
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # a dead master fails in seconds, not 90
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - an optional dependency

            store = MooncakeDistributedStore()
            me = local_address_towards(self.master.rsplit(":", 1)[0])
            code = store.setup(me, "P2PHANDSHAKE", 0, self.buffer, "tcp", "", self.master)
            if code != 0:
                raise ProducerError(f"cannot reach the Mooncake store at master {self.master} (setup: code {code})")
            self._store, self._pid = store, os.getpid()
        return self._store

    def fetch(self, handle: dict) -> Taken | None:
        key, size, algorithm, digest = check_handle(handle, "key")
        if not STORE_KEY.match(key):
            raise HandleError(
                f"the reply names the store key {key[:200]!r}, not one the service puts "
                "(speculators/HOST/PID-START/online_N): refused, nothing read or removed"
            )
        with self._lock:
            return self._fetch(key, size, algorithm, digest)

    def _fetch(self, key: str, size: int, algorithm: str, digest: str) -> Taken | None:
        store = self._client()
        data = store.get(key)
        if len(data) != size:
            return None  # gone (reclaimed), or the store failed: Mooncake's get says which only in its log
        check_safetensors_frame(bytes(data[: min(size, 8 + _HEADER_MAX)]), size)
        check = new_digest(algorithm)
        check.update(data)
        if check.hexdigest() != digest:
            raise StaleFile(f"{key}: its {algorithm} differs from the reply's")
        # a private copy for upstream's reader, deleted once read (no folder: forked workers never run atexit)
        fd, name = tempfile.mkstemp(prefix=f"speculators-online-{os.getpid()}-", suffix=".safetensors", dir=SCRATCH)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        store.remove(key, True)  # taken
        return Taken(Path(name))

    def keep(self, taken: Taken, kept: Path) -> Path:
        try:
            os.replace(taken.path, kept)
        except OSError:  # another filesystem
            shutil.copyfile(taken.path, kept.with_suffix(".part"))
            os.replace(kept.with_suffix(".part"), kept)
            taken.release()
        return kept

    def where(self, handle: dict) -> str:
        return f"{handle['key']} could not be read from the Mooncake store at master {self.master}"


def _service_of(folder_fd: int) -> str | None:
    """The service start the folder's journal names (its first line's ``service``), never through a link; None
    where there is no such journal."""
    try:
        fd = os.open(JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        first = os.pread(fd, 4096, 0).split(b"\n", 1)[0]
    finally:
        os.close(fd)
    try:
        service = json.loads(first).get("service")
    except (ValueError, AttributeError):
        return None
    return service if isinstance(service, str) else None


def folder_reader(backend: dict, folder, producer: str) -> FolderReader:
    """The reader of the folder this consumer was given (``folder``, else :data:`SERVE_DIR_VARIABLE`), once it is
    shown to be the producer's: it holds the journal of the service start the producer names (``service``), or,
    where the producer names none, it is the folder the producer names (device and inode, as this host sees it).
    ProducerError naming both otherwise: nothing is read or deleted in a folder the producer merely names."""
    theirs, service = backend.get("dir"), backend.get("service")
    if folder is None:
        folder = os.environ.get(SERVE_DIR_VARIABLE) or None
    if folder is None:
        raise ProducerError(
            f"the producer {producer} publishes to the folder {str(theirs)[:300]!r}: this consumer reads and deletes "
            f"files only in a folder it is given: folder= (where this host sees the service's --serve-dir), or "
            f"{SERVE_DIR_VARIABLE}"
        )
    folder = Path(folder)
    mismatch = f"the producer {producer} publishes to the folder {str(theirs)[:300]!r}, not to {folder}"
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ProducerError(f"{mismatch}: {folder} cannot be opened ({exc.strerror or exc})") from None
    try:
        if service is not None:
            mine = _service_of(fd)
            if mine != service:
                held = "no service's journal" if mine is None else f"the journal of another service start ({mine})"
                raise ProducerError(f"{mismatch}: {folder} holds {held}, the producer's is {service}")
        else:
            here = os.fstat(fd)
            try:
                named = os.stat(theirs) if isinstance(theirs, str) and theirs else None
            except (OSError, ValueError):
                named = None
            if named is None or (named.st_dev, named.st_ino) != (here.st_dev, here.st_ino):
                raise ProducerError(f"{mismatch}: another folder, or none, as this host sees them")
    finally:
        os.close(fd)
    return FolderReader(folder)


def reader_for(info: dict, folder, producer: str) -> FolderReader | MooncakeReader:
    """The reader of the producer's backend; the folder is this consumer's own (:func:`folder_reader`)."""
    try:
        backend = info["backend"]
        kind = backend["kind"]
        if kind == "folder":
            return folder_reader(backend, folder, producer)
        if kind == "mooncake":
            return MooncakeReader(backend["master"], backend["max_object_bytes"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProducerError(f"the producer's /v1/info names no backend this client can use ({exc!r})") from None
    raise ProducerError(f"the producer publishes to a backend this client does not know: {kind!r}")
