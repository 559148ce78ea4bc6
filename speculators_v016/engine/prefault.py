"""Host memory for the next prompts' states, faulted in ahead on threads of their own.

The engine's thread copies each step's rows out of its ring slot into the
request's own tensors. Into fresh memory that copy also pays the kernel's page
faults (a fault and the zeroing of each 4 KiB page on first touch): on an H200
host a 448 MiB step took 49-71 ms into fresh tensors against 10-13 ms into
touched ones (``tools/benchmarks/host_path.py``), and at hidden 7168 the GPU's
step is shorter than that, so the engine's thread, not the GPU, set the pace
(``tools/benchmarks/gpu_generator.py``: the generator at 0.84x of vLLM's loop).

The scheduler runs prompts in the order they were admitted, and a prompt's
length is known at admission, so its tensors can be made and touched before
its first rows arrive. :class:`Prefaulter` does that on a few threads of its
own, for the prompts next in line, never holding more than ``limit_bytes``
made but not yet taken. What the caller gets is the same: the tensors
``allocate`` made (fresh ones, or a buffer pool's blocks), with every byte of
a prompt's states written by the engine's copy; touching only wrote zeros
that the copy overwrites. A prompt whose tensors are not ready in time (not
started yet) is made on the engine's thread as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from math import prod

import torch

from speculators_v016.config import PREFAULT_BYTES, PREFAULT_THREADS

Spec = tuple[tuple[int, ...], torch.dtype]
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def spec_bytes(specs: Sequence[Spec]) -> int:
    return sum(prod(shape) * dtype.itemsize for shape, dtype in specs)


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc.madvise
    except (OSError, AttributeError):
        return None


_MADVISE = _madvise() if sys.platform.startswith("linux") else None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux for transparent huge pages under ``tensor``'s whole pages (``madvise(MADV_HUGEPAGE)``, which
    the kernel honours in its default ``madvise`` mode and ignores under ``never``); False where it refused.

    Faulting 2 MiB at a time touched 8-9 GB/s per thread against 1.6-1.7 GB/s in 4 KiB pages (measured on
    an AVX2 EPYC host; the zeroing is the same, the faults 512 times fewer). The memory is the same memory,
    at most a huge page's worth more resident at each end."""
    size = tensor.numel() * tensor.element_size()
    if _MADVISE is None or size < HUGE_PAGE:
        return False
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + size) // PAGE * PAGE
    return end > start and _MADVISE(start, end - start, MADV_HUGEPAGE) == 0


def touch(tensor: torch.Tensor) -> None:
    """Write one byte of every page of ``tensor`` (contiguous) so that its faults happen here, not later.

    numpy's strided store releases the GIL and stays on this thread (a torch op would use the intra-op
    pool that the engine's copies use)."""
    advise_huge_pages(tensor)
    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    flat[::PAGE] = 0


def _make(allocate: Callable[[Sequence[Spec]], list[torch.Tensor]], specs: list[Spec]) -> list[torch.Tensor]:
    tensors = allocate(specs)
    for tensor in tensors:
        touch(tensor)
    return tensors


class Prefaulter:
    """Tensors for requests next in line, made by ``allocate`` and touched on ``threads`` threads ahead of use."""

    def __init__(self, allocate: Callable[[Sequence[Spec]], list[torch.Tensor]], limit_bytes: int, threads: int):
        self.allocate = allocate
        self.limit_bytes = limit_bytes
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="speculators-prefault")
        self._ahead: dict[str, tuple[list[Spec], int, Future]] = {}  # request -> (specs, bytes, its tensors)
        self._lock = threading.Lock()
        self.held = 0  # bytes offered and not taken yet
        self.hits = 0  # requests whose tensors were ready (or being made) when their first rows came
        self.misses = 0  # requests made on the caller's thread after all (offered too late, or never)

    def offer(self, key: str, specs: Sequence[Spec]) -> bool:
        """Start making ``key``'s tensors if that keeps :attr:`held` within the limit; False: no room now
        (the first offer is always taken, so a prompt larger than the limit is still made ahead alone)."""
        size = spec_bytes(specs)
        with self._lock:
            if key in self._ahead:
                return True
            if self._ahead and self.held + size > self.limit_bytes:
                return False
            specs = [(tuple(shape), dtype) for shape, dtype in specs]
            self._ahead[key] = (specs, size, self._pool.submit(_make, self.allocate, specs))
            self.held += size
            return True

    def take(self, key: str, specs: Sequence[Spec]) -> list[torch.Tensor]:
        """``key``'s tensors: the ones made ahead (waiting for them if a thread is on it now), else new ones."""
        with self._lock:
            entry = self._ahead.pop(key, None)
            if entry is not None:
                self.held -= entry[1]
        wanted = [(tuple(shape), dtype) for shape, dtype in specs]
        if entry is not None and entry[0] == wanted and not entry[2].cancel():
            try:
                tensors = entry[2].result()
            except CancelledError:
                tensors = None
            if tensors is not None:
                self.hits += 1
                return tensors
        self.misses += 1
        return self.allocate(wanted)

    def close(self) -> None:
        """Stop: offers not started are cancelled; tensors made and never taken are dropped."""
        with self._lock:
            self._ahead.clear()
            self.held = 0
        self._pool.shutdown(wait=False, cancel_futures=True)


def prefaulter(allocate: Callable[[Sequence[Spec]], list[torch.Tensor]], copy_threads: int | None) -> Prefaulter | None:
    """The engine's prefaulter: on GPU engines (``copy_threads`` set), with up to :data:`PREFAULT_THREADS` threads
    leaving at least half the cores free; none on CPU engines, whose forward shares the host's cores and runs far
    longer than their copies."""
    if copy_threads is None:
        return None
    threads = max(1, min(PREFAULT_THREADS, len(os.sched_getaffinity(0)) // 4))
    return Prefaulter(allocate, PREFAULT_BYTES, threads)
