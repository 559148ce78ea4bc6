"""Host buffers for samples' tensors, recycled once the writer is done with them.

Copying a step's rows out of its ring slot into fresh memory costs the page
faults of that memory on every step: on an AVX2 host, 448 MiB (a Kimi-shaped
8192-token step) took 107 ms into fresh tensors and 22 ms into reused ones
(``tools/benchmarks/host_path.py``; an H200 host measured 49-71 ms against
10-13 ms). The pool hands each request one block that holds all its tensors
(:meth:`BufferPool.take`, a list of ``(shape, dtype)``: hidden states, or codes
and scales) and takes it back whole (:meth:`BufferPool.give_back`) once the
sample's file is written, so in a steady run no new memory is touched.

Blocks come in size classes (at most 1/8 above the request); a free block is
reused for any request it fits without wasting more than half of it. Free
blocks beyond ``keep_bytes`` are dropped, least recently used first; a block
that is never given back (an aborted run) is freed with the pool.

On a CPU engine (``fresh_below``, :data:`MALLOC_MMAP_CEILING`) a sample whose
every tensor is smaller than glibc's mmap ceiling gets fresh tensors instead,
given back to the allocator with the sample. glibc serves such sizes from its
heap once a freed chunk of that size has raised its mmap threshold, and a freed
sample leaves its memory there for the next allocation, vLLM's own included:
a CPU engine's forward runs in this process and makes a 56 MiB activation
several times a layer (hidden 7168, 2048 tokens a step, float32), each a fresh
mmap whose 4 KiB pages fault unless the heap holds a free chunk that size.
Pooled, the samples' memory never returned to the heap and the wide CPU
benchmark's CLI faulted 11.0 M pages in its pass against the generator's
9.3-9.8 M (about 2 CPU-s more in the kernel, 0.06 CPU-s per 1,000 tokens);
with fresh memory 9.7-10.3 M (``tools/benchmarks/generator_vs_llm.py``,
docs/benchmarks/README.md). Tensors at or above the ceiling are always fresh
mmaps in glibc, so they stay pooled.

A sample's tensors lie as its file's data does (``align``, the sample file
format's ``DATA_ALIGN``): one after the other from a block start that is a
multiple of ``align`` (fresh tensors: each at an address equal to that offset
modulo ``align``), so the writer sends them to the disk with ``O_DIRECT`` from
where they lie, no copy (:mod:`~speculators_v016.store.direct_io`). A tensor
whose offset is not a multiple of its element size starts at the next one
(correct still: that tensor and those after it are written through a bounce
buffer).

With ``shared`` the blocks are memfd-backed shared memory, each with its own descriptor, so the writers' helper
processes (:mod:`~speculators_v016.store.write_helper`) read a sample's tensors where they lie:
:meth:`BufferPool.locate` names the block and the offset of a buffer inside one, :meth:`BufferPool.live` the
blocks not dropped yet (a helper unmaps the others).

With ``pin`` (a GPU engine whose worker copies rows straight into a sample's
tensors, :meth:`~speculators_v016.engine.assembly.Assembler.place`) every block is
registered with CUDA as pinned memory when it is made, so the device-to-host
copies land in it asynchronously. A new block's pages are faulted in first (huge
pages advised: :func:`~speculators_v016.engine.prefault.touch`): registering a
fresh block, whose pages the driver then faults and zeroes itself, stalled every
other thread's CUDA calls for as long (``tools/benchmarks/host_pinning.py`` on an
H100: a step loop beside it at 1,048 ms a step against 4.85 alone; beside touched
blocks registered at 38 GiB/s, 4.85 ms), and the first CLI run with rows placed
spent 6.6 s more in vLLM's steps than the slot path (docs/benchmarks/README.md).
A pinned pool keeps free blocks up to ``keep_bytes`` or the most bytes it ever had
lent at once, whichever is more, so a run registers its working set about once
and holds that peak plus as much again (or ``keep_bytes``) at most; a block
dropped beyond that is unregistered outside
the pool's lock, after a device synchronize (its copies landed before its sample
was handed out; the synchronize makes that so whatever the path). Every block
left is unregistered at :meth:`BufferPool.close`, after a device synchronize: no
copy can still be landing in memory that goes back to the system.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from math import prod

import torch

from speculators_v016.engine.prefault import touch

TORCH_ALIGN = 64  # bytes: where torch's CPU allocator starts every allocation (a multiple of it)
#: glibc's largest dynamic mmap threshold on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``, mallopt(3)): smaller
#: allocations may come from (and go back to) its heap, larger ones are always mmaps of their own.
MALLOC_MMAP_CEILING = 32 << 20


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of its highest power of two (at most 12.5% more)."""
    if nbytes <= 4096:
        return 4096
    step = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


class BufferPool:
    """Blocks of host memory carved into a sample's tensors, handed out and taken back by whole blocks."""

    def __init__(
        self, keep_bytes: int = 2 << 30, fresh_below: int = 0, align: int = 64, shared: bool = False, pin: bool = False
    ):
        if pin and fresh_below:
            raise ValueError("a pinned pool hands out blocks only (fresh_below must be 0)")
        self.pin = pin  # every block registered as pinned memory (see the module's docstring); False once closed
        self.keep_bytes = keep_bytes
        self.shared = shared  # blocks in memfd-backed shared memory (see the module's docstring)
        self._descriptors: dict[int, tuple[int, int]] = {}  # shared: data_ptr -> (block id, its memfd)
        self._ids = itertools.count(1)
        self.align = align  # a block's first tensor starts at a multiple of it (see the module's docstring)
        self.fresh_below = fresh_below  # a sample whose tensors are all smaller: fresh tensors, not a block
        self._free: OrderedDict[int, torch.Tensor] = OrderedDict()  # data_ptr -> block, oldest first
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> block
        self._fresh: set[int] = set()  # data_ptr of the first tensor of each sample lent fresh tensors
        self._lock = threading.Lock()
        self.allocated = 0  # blocks made (a steady run stops making them)
        self.reused = 0
        self.fresh = 0  # samples given fresh tensors (fresh_below)
        self.lent_bytes = 0  # in blocks lent now
        self.peak_lent_bytes = 0  # the most ever lent at once (a pinned pool keeps free blocks up to it)
        # a pinned pool dropped without close(): its blocks are kept (STRANDED), never freed while registered
        self._unclosed = weakref.finalize(self, _strand, self._free, self._lent) if pin else None

    def take(self, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
        """Uninitialised contiguous tensors of the given shapes and dtypes, all in one block."""
        itemsizes = [torch.empty((), dtype=dtype).element_size() for _, dtype in specs]
        sizes = [prod(shape) * item for (shape, _), item in zip(specs, itemsizes)]
        offsets, total = [], 0
        for size, item in zip(sizes, itemsizes):
            total += -total % item
            offsets.append(total)
            total += size
        if specs and max(sizes) < self.fresh_below:
            tensors = [self._fresh_tensor(o, n, shape, dtype) for o, n, (shape, dtype) in zip(offsets, sizes, specs)]
            with self._lock:
                self._fresh.add(tensors[0].untyped_storage().data_ptr())
                self.fresh += 1
            return tensors
        total += max(0, self.align - TORCH_ALIGN)  # room to start on a multiple of align
        block = self._reuse(total)
        if block is None:
            block = self._allocate(total)
        base = -block.data_ptr() % self.align
        return [
            block[base + o : base + o + n].view(dtype).view(tuple(shape))
            for o, n, (shape, dtype) in zip(offsets, sizes, specs)
        ]

    def _fresh_tensor(self, offset: int, size: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor at an address equal to ``offset`` modulo :attr:`align` (its own storage)."""
        if self.align <= TORCH_ALIGN and offset % self.align == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        raw = torch.empty(size + self.align, dtype=torch.uint8)
        start = (offset - raw.data_ptr()) % self.align
        return raw[start : start + size].view(dtype).view(tuple(shape))

    def _reuse(self, total: int) -> torch.Tensor | None:
        with self._lock:
            fits = [(b.numel(), ptr) for ptr, b in self._free.items() if total <= b.numel() <= 2 * max(total, 4096)]
            if not fits:
                return None
            ptr = min(fits)[1]
            block = self._free.pop(ptr)
            self._lend(ptr, block)
            self.reused += 1
            return block

    def _lend(self, ptr: int, block: torch.Tensor) -> None:
        """``block`` lent (``_lock`` held)."""
        self._lent[ptr] = block
        self.lent_bytes += block.numel()
        self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes)

    def _allocate(self, total: int) -> torch.Tensor:
        if self.shared:
            block, fd = _shared_block(size_class(total))
        else:
            block = torch.empty(size_class(total), dtype=torch.uint8)
        registered = self.pin
        if registered:
            touch(block)  # its pages faulted in here (huge pages advised), so the driver only pins them
            _register(block)
        with self._lock:
            self._lend(block.data_ptr(), block)
            if self.shared:
                self._descriptors[block.data_ptr()] = (next(self._ids), fd)
            self.allocated += 1
            closed_meanwhile = registered and not self.pin  # close unregistered the blocks it knew, not this one
        if closed_meanwhile:
            _unpin_all([block])
        return block

    def _drop(self, ptr: int) -> torch.Tensor:
        """Forget a free block (``_lock`` held) and return it: its memory goes once its tensors do (shared: its
        memfd closed; pinned: the caller unregisters it first)."""
        block = self._free.pop(ptr)
        if ptr in self._descriptors:
            os.close(self._descriptors.pop(ptr)[1])
        return block

    def locate(self, address: int, length: int) -> tuple[int, int, int, int] | None:
        """``(block id, memfd, block size, offset)`` of the ``length`` bytes at ``address`` where they lie inside
        one lent shared block; None elsewhere (or without ``shared``)."""
        with self._lock:
            for ptr, (block, fd) in self._descriptors.items():
                size = self._lent[ptr].numel() if ptr in self._lent else 0
                if ptr <= address and address + length <= ptr + size:
                    return block, fd, size, address - ptr
        return None

    def live(self) -> set[int]:
        """The ids of the shared blocks not dropped."""
        with self._lock:
            return {block for block, _ in self._descriptors.values()}

    def give_back(self, tensors: Sequence[torch.Tensor]) -> None:
        """Return the block that ``tensors`` (as :meth:`take` gave them) live in; their memory is reused (fresh
        tensors: the allocator's again once the caller drops them)."""
        if not tensors:
            return
        ptr = tensors[0].untyped_storage().data_ptr()
        dropped = []
        with self._lock:
            if ptr in self._fresh:
                self._fresh.discard(ptr)
                return
            block = self._lent.pop(ptr, None)
            if block is None:
                raise RuntimeError("these tensors were not taken from this pool, or were given back twice")
            self.lent_bytes -= block.numel()
            self._free[ptr] = block
            held = sum(b.numel() for b in self._free.values())
            keep = max(self.keep_bytes, self.peak_lent_bytes) if self.pin else self.keep_bytes
            while held > keep and self._free:
                oldest = next(iter(self._free))
                held -= self._free[oldest].numel()
                dropped.append(self._drop(oldest))
            unpin = self.pin  # False once closed: close unregistered every block then, these too
        if dropped and unpin:
            _unpin_all(dropped)  # outside the lock: the device synchronize waits for the steps in flight

    def close(self) -> None:
        """Drop the free blocks, unregister every pinned block (lent ones too) and close every shared block's
        memfd (the memory goes with the last tensor)."""
        with self._lock:
            try:
                if self.pin:
                    self.pin = False  # a second close unregisters nothing
                    self._unclosed.detach()
                    _unpin_all([*self._free.values(), *self._lent.values()])  # a failure strands them
            finally:
                self._free.clear()
                for _, fd in self._descriptors.values():
                    os.close(fd)
                self._descriptors.clear()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free.values())

    @property
    def lent(self) -> int:
        """Samples whose memory is out (blocks and fresh tensors)."""
        with self._lock:
            return len(self._lent) + len(self._fresh)


def _register(block: torch.Tensor) -> None:
    """Register ``block``'s memory with CUDA as pinned (page-locked) memory."""
    err = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), block.numel(), 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of a {block.numel()}-byte sample block failed: CUDA error {err}")


#: Pinned blocks whose unregistering failed (or whose device synchronize did): kept for the process's life, so
#: that their memory is never handed to anything else while the driver still holds it, or a copy may still land.
STRANDED: list[torch.Tensor] = []


def _unpin_all(blocks: Sequence[torch.Tensor]) -> None:
    """Undo :func:`_register` for every block, once every copy on the device is done (one may still be landing in
    one); the first failure is raised after every block was tried. A block not unregistered (the synchronize
    failed, or its unregistering did) stays allocated, in :data:`STRANDED`."""
    try:
        torch.cuda.synchronize()
    except BaseException:
        STRANDED.extend(blocks)
        raise
    failed = []
    for i, block in enumerate(blocks):
        try:
            err = int(torch.cuda.cudart().cudaHostUnregister(block.data_ptr()))
        except BaseException:
            STRANDED.extend(blocks[i:])  # this one and those not tried: still registered
            raise
        if err:
            failed.append((block.numel(), err))
            STRANDED.append(block)
    if failed:
        raise RuntimeError(
            f"cudaHostUnregister failed for {len(failed)} sample blocks (size, CUDA error): {failed}; "
            "their memory stays allocated"
        )


def _strand(free: dict, lent: dict) -> None:
    """A pinned pool dropped without :meth:`BufferPool.close`: keep its blocks (still registered) for good."""
    STRANDED.extend([*free.values(), *lent.values()])


def _shared_block(size: int) -> tuple[torch.Tensor, int]:
    """``size`` bytes of memfd-backed shared memory as a uint8 tensor, and the memfd (close-on-exec)."""
    fd = os.memfd_create("speculators-sample-block", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        region = mmap.mmap(fd, size)  # shared, read and write; unmapped once the tensor and its views are gone
    except BaseException:
        os.close(fd)
        raise
    return torch.frombuffer(region, dtype=torch.uint8), fd
