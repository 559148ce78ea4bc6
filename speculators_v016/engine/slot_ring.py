"""A bounded ring of host slots that carries captured states from the worker to the engine.

Each slot holds one step: ``[capture ids, max rows, hidden]`` in the engine's
dtype, so every captured layer lands as one contiguous block (one device-to-
host copy per layer, no strided writes). The engine owns the ring: it creates
it before the workers exist, hands a slot to each step it launches and takes
it back once the step's rows are copied out (:meth:`SlotRing.acquire`,
:meth:`SlotRing.release`). The output-rank worker maps the ring once
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
  ``speculators-v016-ring-<pid>-<token>``. The engine unlinks it as soon as
  the worker has mapped it, so even a SIGKILL leaves nothing behind after
  that point; :mod:`speculators_v016.engine.shm_sweep` reclaims the rest.
* **local** (uniprocess executor): plain memory of this process, found by the
  worker (same process) through a registry.
"""

from __future__ import annotations

import os
import secrets
import weakref

import torch

from speculators_v016.protocol import PREFIX, SHM_DIR, RingSpec

_LOCAL: dict[str, torch.Tensor] = {}  # name -> buffer, for the uniprocess executor


class RingSpaceError(OSError):
    """``/dev/shm`` cannot hold the capture ring."""


def _shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


class SlotRing:
    """The slots, mapped in this process; the owner (engine) also tracks which are free."""

    def __init__(self, spec: RingSpec, buffer: torch.Tensor, owner: bool):
        self.spec = spec
        self.buffer = buffer.view(spec.slots, spec.num_ids, spec.max_rows, spec.hidden)
        self.owner = owner
        self._free = list(range(spec.slots))
        self._unpin: weakref.finalize | None = None  # undoes cudaHostRegister, at close or when dropped
        self._unlinked = not spec.shared
        if owner:
            self._finalizer = weakref.finalize(self, _discard, spec.name, spec.path if spec.shared else None)

    # -- creation and mapping -------------------------------------------
    @classmethod
    def create(cls, *, slots: int, num_ids: int, max_rows: int, hidden: int, dtype: torch.dtype,
               shared: bool) -> SlotRing:
        """Make a ring (the engine). ``shared``: a ``/dev/shm`` file for worker processes."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        spec = RingSpec(name, shared, slots, num_ids, max_rows, hidden, str(dtype).removeprefix("torch."))
        if not shared:
            buffer = torch.empty(slots * spec.slot_numel, dtype=dtype)
            _LOCAL[name] = buffer
            return cls(spec, buffer, owner=True)
        free = _shm_free_bytes()
        if free < spec.total_bytes:
            raise RingSpaceError(_space_message(spec, free))
        fd = os.open(spec.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, spec.total_bytes)  # reserve now: no SIGBUS mid-run
        except OSError as exc:
            os.close(fd)
            os.unlink(spec.path)
            raise RingSpaceError(_space_message(spec, _shm_free_bytes())) from exc
        os.close(fd)
        try:
            return cls(spec, _map(spec), owner=True)
        except BaseException:
            os.unlink(spec.path)
            raise

    @classmethod
    def attach(cls, spec: RingSpec) -> SlotRing:
        """Map an existing ring (the output-rank worker)."""
        if not spec.shared:
            if spec.name not in _LOCAL:
                raise RuntimeError(f"capture ring {spec.name} is not in this process "
                                   "(a local ring needs the uniprocess executor)")
            return cls(spec, _LOCAL[spec.name], owner=False)
        return cls(spec, _map(spec), owner=False)

    def unlink(self) -> None:
        """Remove the ``/dev/shm`` name (mappings stay valid); call once every worker has mapped it."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass

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
        """Slot ``index``: a ``[num_ids, max_rows, hidden]`` view."""
        return self.buffer[index]

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


def _map(spec: RingSpec) -> torch.Tensor:
    numel = spec.slots * spec.slot_numel
    return torch.from_file(spec.path, shared=True, size=numel, dtype=spec.torch_dtype)


def _unregister(buffer: torch.Tensor) -> int:
    """Undo ``cudaHostRegister`` of ``buffer``; the error code (0: done). Also runs at process exit."""
    try:
        return int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    except Exception:  # noqa: BLE001 - the CUDA runtime may be gone at interpreter exit
        return -1


def _discard(name: str, path: str | None) -> None:
    _LOCAL.pop(name, None)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _space_message(spec: RingSpec, free: int) -> str:
    return (f"{SHM_DIR} has {free / 2**20:,.0f} MiB free, but the capture ring needs "
            f"{spec.total_bytes:,} bytes ({spec.describe()}). Lower --max-num-batched-tokens "
            f"(now {spec.max_rows}) or capture fewer layers, or give the container a larger "
            f"{SHM_DIR} (docker run --shm-size)")
