"""A bounded ring of host slots that carries captured states from the worker to the engine.

Each slot holds one step: ``[capture ids, max rows, hidden]`` in the engine's
dtype, so every captured layer lands as one contiguous block (one device-to-
host copy per layer, no strided writes). With FP8 storage a slot holds the
e4m3 codes in that shape, then ``[capture ids, max rows]`` float32 scales
(:class:`~speculators_v016.protocol.RingSpec` has the byte layout). The
engine owns the ring: it creates it before the workers exist, hands a slot
to each step it launches and takes it back once the step's rows are copied
out (:meth:`SlotRing.acquire`, :meth:`SlotRing.release`). The output-rank worker maps the ring once
(:meth:`SlotRing.attach`) and, on GPUs, registers it once as pinned memory,
so a step costs no allocation and the capture RPC carries metadata only.

The registration belongs to the mapping that made it, owner or not: it is
undone by :meth:`SlotRing.close` (the worker's capture close, run on engine
close and on re-attach) and, failing that, by a finalizer when the mapping is
dropped or the process exits, always before the memory can be unmapped. A
range left registered after its memory is gone makes a later registration at
the same addresses fail (``cudaErrorHostMemoryAlreadyRegistered``).

Two backings:

* **shared** (multiprocess executors): a file in ``/dev/shm`` named
  ``speculators-v016-ring-<pid>-<random>``, created with ``O_EXCL`` and mapped
  by the engine through the descriptor it created. Its first page is a header:
  a magic string, a random identity token (also in the :class:`RingSpec` the
  worker receives) and the shape. The worker opens the name without
  ``O_CREAT`` and without following links, and maps it only if the size, the
  owner, the token and the shape all match: a name that vanished (a
  ``/dev/shm`` cleaner, systemd's ``RemoveIPC``) or was replaced fails the run
  at start with :class:`RingIdentityError`, never maps a new empty file whose
  zeros would be written as states. The engine unlinks the name as soon as the
  worker has mapped it, so even a SIGKILL leaves nothing behind after that
  point; before it, the run's shared-memory record
  (:mod:`speculators_v016.shared.shm_records`) names it for the next run to reclaim.
* **local** (uniprocess executor): plain memory of this process, found by the
  worker (same process) through a registry.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
import struct
import weakref
from collections.abc import Callable

import torch

from speculators_v016.protocol import PREFIX, SHM_DIR, RingSpec

_LOCAL: dict[str, torch.Tensor] = {}  # name -> buffer, for the uniprocess executor

#: Bytes before the slots in a shared ring's file (one page: the slots stay page-aligned for pinning).
HEADER_BYTES = 4096
MAGIC = b"speculators-ring"
#: magic, token, slots, num_ids, max_rows, hidden, dtype, hidden_states_dtype
_HEADER = struct.Struct("<16s16sQQQQ16s16s")


class RingSpaceError(OSError):
    """``/dev/shm`` cannot hold the capture ring."""


class RingIdentityError(RuntimeError):
    """The shared ring's file is not the one the engine created (gone, replaced, resized, not ours)."""


def _shm_free_bytes(directory: str = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def file_bytes(spec: RingSpec) -> int:
    """Size of a shared ring's file: the header page, then the slots."""
    return HEADER_BYTES + spec.total_bytes


def _header(spec: RingSpec) -> bytes:
    return _HEADER.pack(
        MAGIC,
        bytes.fromhex(spec.token),
        spec.slots,
        spec.num_ids,
        spec.max_rows,
        spec.hidden,
        spec.dtype.encode(),
        spec.hidden_states_dtype.encode(),
    )


class SlotRing:
    """The slots, mapped in this process; the owner (engine) also tracks which are free."""

    def __init__(self, spec: RingSpec, buffer: torch.Tensor, owner: bool, identity: tuple[int, int] | None = None):
        self.spec = spec
        self.buffer = buffer.view(spec.slots, spec.slot_bytes)  # uint8: slot i is row i
        self._states = [
            self.buffer[i, : spec.states_bytes].view(spec.state_dtype).view(spec.num_ids, spec.max_rows, spec.hidden)
            for i in range(spec.slots)
        ]
        self._scales = [
            self.buffer[i, spec.scales_offset : spec.scales_offset + spec.scales_bytes]
            .view(torch.float32)
            .view(spec.num_ids, spec.max_rows)
            if spec.fp8
            else None
            for i in range(spec.slots)
        ]
        self.owner = owner
        self._identity = identity  # (device, inode) of the file we created: only that one is ever unlinked
        self._free = list(range(spec.slots))
        self._unpin: weakref.finalize | None = None  # undoes cudaHostRegister, at close or when dropped
        self._unlinked = not spec.shared
        if owner:
            self._finalizer = weakref.finalize(self, _discard, spec.name, spec.path if spec.shared else None, identity)

    # -- creation and mapping -------------------------------------------
    @classmethod
    def create(
        cls,
        *,
        slots: int,
        num_ids: int,
        max_rows: int,
        hidden: int,
        dtype: torch.dtype,
        shared: bool,
        directory: str = SHM_DIR,
        hidden_states_dtype: str = "auto",
        created: Callable[[str, os.stat_result], None] | None = None,
    ) -> SlotRing:
        """Make a ring (the engine). ``shared``: a file in ``directory`` for worker processes.

        ``dtype`` is the engine's; ``hidden_states_dtype="fp8_e4m3"`` makes the slots hold codes and scales.
        ``created(name, stat)`` is called as soon as the file exists, before the
        (slow) space reservation: the run records the name there, so a crash
        at any later point leaves a segment the next run can attribute.
        """
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        spec = RingSpec(
            name,
            shared,
            slots,
            num_ids,
            max_rows,
            hidden,
            str(dtype).removeprefix("torch."),
            token=secrets.token_hex(16) if shared else "",
            directory=directory,
            hidden_states_dtype=hidden_states_dtype,
        )
        if not shared:
            buffer = torch.empty(spec.total_bytes, dtype=torch.uint8)
            _LOCAL[name] = buffer
            return cls(spec, buffer, owner=True)
        free = _shm_free_bytes(directory)
        if free < file_bytes(spec):
            raise RingSpaceError(_space_message(spec, free))
        fd = os.open(spec.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        try:
            if created is not None:
                created(spec.name, st)
            try:
                os.posix_fallocate(fd, 0, file_bytes(spec))  # reserve now: no SIGBUS mid-run
            except OSError as exc:
                raise RingSpaceError(_space_message(spec, _shm_free_bytes(directory))) from exc
            os.pwrite(fd, _header(spec), 0)
            buffer = _map(fd, spec)  # through our descriptor: the name is never opened again here
        except BaseException:
            _unlink_if_same(spec.path, identity)
            raise
        finally:
            os.close(fd)
        return cls(spec, buffer, owner=True, identity=identity)

    @classmethod
    def attach(cls, spec: RingSpec) -> SlotRing:
        """Map the engine's ring (the output-rank worker); never creates one.

        A shared ring is opened without ``O_CREAT`` and without following
        links, and mapped only if it is a regular file of this user with the
        expected size and the creator's header (token and shape): anything
        else raises :class:`RingIdentityError`.
        """
        if not spec.shared:
            if spec.name not in _LOCAL:
                raise RuntimeError(
                    f"capture ring {spec.name} is not in this process (a local ring needs the uniprocess executor)"
                )
            return cls(spec, _LOCAL[spec.name], owner=False)
        if len(spec.token) != 32:
            raise RingIdentityError(f"capture ring {spec.path}: the spec carries no identity token")
        fd = _open_existing(spec)
        try:
            _check_identity(fd, spec)
            return cls(spec, _map(fd, spec), owner=False)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Remove the ``/dev/shm`` name (mappings stay valid); call once every worker has mapped it."""
        if not self._unlinked:
            self._unlinked = True
            _unlink_if_same(self.spec.path, self._identity)

    def pin(self) -> None:
        """Register the mapped slots as pinned memory (once), for direct device-to-host copies."""
        if self.pinned or not torch.cuda.is_available():
            return
        err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.spec.total_bytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the capture ring ({self.spec.describe()}) failed: {err}")
        # The finalizer holds the buffer: the memory stays mapped until it is unregistered.
        self._unpin = weakref.finalize(self, _unregister, self.buffer)

    @property
    def pinned(self) -> bool:
        """Registered with CUDA by this mapping (and not yet unregistered)."""
        return self._unpin is not None and self._unpin.alive

    def close(self) -> None:
        """Unregister (if pinned), unlink (owner) and forget the slots; the mapping goes with the last view.

        Call only once no copy into the slots is in flight.
        """
        unpin, self._unpin = self._unpin, None
        err = unpin() if unpin is not None else None
        if self.owner:
            self._finalizer()
        if err:
            raise RuntimeError(f"cudaHostUnregister of the capture ring ({self.spec.describe()}) failed: {err}")

    # -- slots --------------------------------------------------------------
    def slot(self, index: int) -> torch.Tensor:
        """Slot ``index``'s states: a ``[num_ids, max_rows, hidden]`` view (e4m3 codes with FP8 storage)."""
        return self._states[index]

    def scales(self, index: int) -> torch.Tensor | None:
        """Slot ``index``'s FP8 scales: a ``[num_ids, max_rows]`` float32 view (None without FP8 storage)."""
        return self._scales[index]

    def acquire(self) -> int:
        """A free slot for the next step (the engine); the caller retires steps when none is free."""
        if not self._free:
            raise RuntimeError(f"all {self.spec.slots} capture slots are in use")
        return self._free.pop(0)

    @property
    def free(self) -> int:
        return len(self._free)

    def release(self, index: int) -> None:
        if index in self._free or not 0 <= index < self.spec.slots:
            raise RuntimeError(f"capture slot {index} released twice or out of range")
        self._free.append(index)


def _map(fd: int, spec: RingSpec) -> torch.Tensor:
    """The slots of the file open as ``fd``, as bytes, mapped shared (the mapping keeps its own reference)."""
    mapping = mmap.mmap(fd, file_bytes(spec), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=spec.total_bytes, offset=HEADER_BYTES)


def _unregister(buffer: torch.Tensor) -> int:
    """Undo ``cudaHostRegister`` of ``buffer``; the error code (0: done). Also runs at process exit."""
    try:
        return int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    except Exception:  # noqa: BLE001 - the CUDA runtime may be gone at interpreter exit
        return -1


_VANISHED = (
    "something removed it between the engine's creation and this worker's mapping (a /dev/shm "
    "cleaner, systemd RemoveIPC at logout, another container's sweep)"
)


def _open_existing(spec: RingSpec) -> int:
    """The ring's file, opened read-write without creating it and without following a link."""
    try:
        return os.open(spec.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RingIdentityError(
            f"capture ring {spec.path} is gone: {_VANISHED}. Refusing to create a new "
            "one: the engine would never see what this worker writes"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RingIdentityError(
                f"capture ring {spec.path} is a symbolic link now, not the engine's "
                f"file: {_VANISHED}, and something else put a link there"
            ) from None
        raise RingIdentityError(f"capture ring {spec.path} cannot be opened: {exc}") from exc


def _check_identity(fd: int, spec: RingSpec) -> None:
    """The file open as ``fd`` is the engine's ring: regular, ours, its size, its token and shape."""
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    elif st.st_size != file_bytes(spec):
        problem = f"holds {st.st_size:,} bytes, the engine's ring {file_bytes(spec):,}"
    elif os.pread(fd, _HEADER.size, 0) != _header(spec):
        problem = "does not carry the engine's identity token and shape in its header"
    if problem is not None:
        raise RingIdentityError(
            f"capture ring {spec.path} {problem}: it is not the file the engine created "
            f"({_VANISHED}, and another file took its name). Refusing to map it"
        )


def _discard(name: str, path: str | None, identity: tuple[int, int] | None) -> None:
    _LOCAL.pop(name, None)
    if path is not None:
        _unlink_if_same(path, identity)


def _unlink_if_same(path: str, identity: tuple[int, int] | None) -> None:
    """Remove ``path`` if it still is the file we created (device, inode; not following a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if identity is None or (st.st_dev, st.st_ino) != identity:
        return  # not ours (any more): never deleted
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _space_message(spec: RingSpec, free: int) -> str:
    return (
        f"{spec.directory} has {free / 2**20:,.0f} MiB free, but the capture ring needs "
        f"{spec.total_bytes:,} bytes ({spec.describe()}). Lower --max-num-batched-tokens "
        f"(now {spec.max_rows}) or capture fewer layers, or give the container a larger "
        f"{spec.directory} (docker run --shm-size)"
    )
