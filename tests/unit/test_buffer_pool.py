"""The buffer pool: one block per sample, reused once given back, bounded when idle."""

import gc
import os

import pytest
import torch

from speculators_v016.engine import buffer_pool
from speculators_v016.engine.assembly import Assembler
from speculators_v016.engine.buffer_pool import MALLOC_MMAP_CEILING, BufferPool, size_class
from speculators_v016.protocol import StepCapture


def test_size_classes_waste_at_most_an_eighth():
    """Blocks are rounded up by at most 1/8 (and to 4 KiB)."""
    for n in [1, 4096, 4097, 10_000, 123_456_789, 117_440_512]:
        c = size_class(n)
        assert n <= c <= max(4096, n * 9 // 8 + 1)


@pytest.mark.parametrize("align", [64, 4096])
def test_one_block_holds_a_samples_tensors(align):
    """Shapes and dtypes as asked, contiguous, non-overlapping, in one block laid out as the file's data is: one
    after the other from a multiple of ``align``, each at a multiple of its element size."""
    pool = BufferPool(align=align)
    a, b, c = pool.take([((5, 3), torch.bfloat16), ((5, 3), torch.bfloat16), ((5,), torch.float32)])
    assert (a.shape, a.dtype, c.shape, c.dtype) == ((5, 3), torch.bfloat16, (5,), torch.float32)
    assert all(t.is_contiguous() for t in (a, b, c)) and a.data_ptr() % align == 0
    assert b.data_ptr() == a.data_ptr() + 30 and c.data_ptr() == a.data_ptr() + 60  # 60: b's end rounded to 4
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    a.fill_(1), b.fill_(2), c.fill_(3)
    assert a.sum() == 15 and b.sum() == 30 and c.sum() == 15
    assert pool.lent == 1 and pool.allocated == 1


def test_a_returned_block_is_reused_without_new_memory():
    """Give back, take again (same or somewhat smaller): the same memory, no new allocation."""
    pool = BufferPool()
    first = pool.take([((1000, 64), torch.float32)] * 2)
    where = first[0].data_ptr()
    pool.give_back(first)
    again = pool.take([((900, 64), torch.float32)] * 2)
    assert again[0].data_ptr() == where and pool.allocated == 1 and pool.reused == 1
    small = pool.take([((10, 64), torch.float32)])  # far smaller than any free block: its own block
    assert pool.allocated == 2 and small[0].data_ptr() != where


def test_giving_back_twice_or_foreign_tensors_is_an_error():
    """Only blocks this pool lent, once each."""
    pool = BufferPool()
    mine = pool.take([((4, 4), torch.float32)])
    pool.give_back(mine)
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give_back(mine)
    with pytest.raises(RuntimeError, match="not taken from this pool"):
        pool.give_back([torch.zeros(4, 4)])


def test_idle_blocks_beyond_the_limit_are_dropped_oldest_first():
    """Free memory kept stays under keep_bytes; the blocks returned last are the ones kept."""
    pool = BufferPool(keep_bytes=3 * 2**20)
    blocks = [pool.take([((2**20,), torch.uint8)]) for _ in range(4)]
    for block in blocks:
        pool.give_back(block)
    assert pool.free_bytes <= 3 * 2**20 and pool.lent == 0
    again = {pool.take([((2**20,), torch.uint8)])[0].data_ptr() for _ in range(3)}
    assert again == {b[0].data_ptr() for b in blocks[1:]} and pool.allocated == 4


def test_samples_under_the_fresh_limit_get_fresh_tensors_and_give_them_back():
    """fresh_below: a sample whose tensors are all smaller gets tensors of its own, no block; larger ones pooled."""
    pool = BufferPool(fresh_below=1 << 20)
    fresh = pool.take([((1000, 64), torch.float32)] * 3 + [((1000,), torch.float32)])  # 256,000 B each
    assert [t.shape for t in fresh] == [(1000, 64)] * 3 + [(1000,)] and fresh[3].dtype == torch.float32
    assert len({t.untyped_storage().data_ptr() for t in fresh}) == 4  # one allocation each, none shared
    assert (pool.fresh, pool.allocated, pool.lent) == (1, 0, 1)
    big = pool.take([((1000, 64), torch.float32), ((5000, 64), torch.float32)])  # one tensor at 1.28 MB: a block
    assert big[0].untyped_storage().data_ptr() == big[1].untyped_storage().data_ptr()
    assert (pool.fresh, pool.allocated, pool.lent) == (1, 1, 2)
    pool.give_back(fresh)
    assert pool.lent == 1 and pool.free_bytes == 0  # fresh memory is the allocator's again, never kept
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give_back(fresh)
    pool.give_back(big)
    assert pool.lent == 0 and pool.free_bytes > 0


def test_fresh_tensors_lie_at_their_file_offsets_modulo_align():
    """Fresh tensors (a CPU engine's) are placed as a block's would be: address = offset in the data, mod align."""
    pool = BufferPool(fresh_below=1 << 30, align=4096)
    tensors = pool.take([((37, 896), torch.bfloat16)] * 3 + [((37,), torch.float32)])
    offsets = [0, 37 * 896 * 2, 2 * 37 * 896 * 2, 3 * 37 * 896 * 2]
    assert [t.data_ptr() % 4096 for t in tensors] == [o % 4096 for o in offsets]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 4 and pool.fresh == 1
    pool.give_back(tensors)
    assert pool.lent == 0


def test_the_fresh_limit_is_glibcs_mmap_ceiling():
    """The CPU engine's limit is glibc's largest dynamic mmap threshold on 64-bit hosts: 32 MiB (mallopt(3))."""
    assert MALLOC_MMAP_CEILING == 4 * 1024 * 1024 * 8
    pool = BufferPool(fresh_below=MALLOC_MMAP_CEILING)
    pool.take([((512, 7168), torch.float32)] * 3)  # the wide benchmark's sample: 14.7 MB a layer
    pool.take([((2048, 7168), torch.float32)] * 3)  # 58.7 MB a layer: glibc maps each afresh, so pooled
    assert (pool.fresh, pool.allocated) == (1, 1)


def test_assembler_puts_states_in_pool_blocks():
    """With a pool's take, a request's per-layer states share one block and hold the right rows."""
    pool = BufferPool()
    asm = Assembler((1, 0), allocate=pool.take)
    asm.add_request("a", "A", 3)
    asm.expect(1, {"a": (0, 3)})
    states = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    asm.add(StepCapture(1, ["a"], [0], [3], states=states))
    [(key, out)] = asm.pop_complete()
    assert key == "A" and torch.equal(out[0], states[1]) and torch.equal(out[1], states[0])
    pool.give_back(out)
    assert pool.lent == 0


def test_a_pinned_pool_hands_out_blocks_only():
    """Pinned blocks take the worker's copies: a pool that would hand out fresh (unpinned) tensors is refused."""
    with pytest.raises(ValueError, match="a pinned pool hands out blocks only"):
        BufferPool(fresh_below=1 << 20, pin=True)


def test_a_pinned_pool_registers_each_block_once_and_keeps_it_while_lent_or_under_the_peak(monkeypatch):
    """Pinned blocks are registered when made, kept past keep_bytes up to the most lent at once, unregistered at close."""
    registered, unregistered = [], []
    monkeypatch.setattr(buffer_pool, "_register", lambda block: registered.append(block.data_ptr()))
    monkeypatch.setattr(buffer_pool, "_unpin_all", lambda blocks: unregistered.extend(b.data_ptr() for b in blocks))
    pool = BufferPool(keep_bytes=4096, pin=True)
    samples = [pool.take([((64, 128), torch.float32)]) for _ in range(3)]
    for sample in samples[:2]:
        pool.give_back(sample)  # 64 KiB free, over keep_bytes, under the 96 KiB once lent: a pinned pool keeps them
    assert len(registered) == 3 and unregistered == [] and pool.free_bytes >= 2 * 64 * 128 * 4
    again = pool.take([((64, 128), torch.float32)])
    assert pool.reused == 1 and len(registered) == 3 and again[0].untyped_storage().data_ptr() in registered
    pool.close()
    assert sorted(unregistered) == sorted(registered)
    pool.close()
    assert len(unregistered) == 3  # a second close unregisters nothing


def test_a_pinned_pool_unregisters_a_block_it_drops_outside_its_lock(monkeypatch):
    """Free pinned blocks beyond the most ever lent at once are dropped: unregistered, with the pool's lock free."""
    registered, unregistered, locked = [], [], []
    monkeypatch.setattr(buffer_pool, "_register", lambda block: registered.append(block.data_ptr()))

    def unpin(blocks):
        locked.append(pool._lock.locked())
        unregistered.extend(b.data_ptr() for b in blocks)

    monkeypatch.setattr(buffer_pool, "_unpin_all", unpin)
    pool = BufferPool(keep_bytes=4096, pin=True)
    small = pool.take([((64, 128), torch.float32)])  # 32 KiB
    pool.give_back(small)  # free 32 KiB, the most lent: kept
    assert unregistered == [] and pool.peak_lent_bytes == size_class(64 * 128 * 4)
    large = pool.take([((256, 128), torch.float32)])  # 128 KiB: the small block does not fit it, a new one
    pool.give_back(large)  # free 160 KiB, over the 128 KiB once lent: the oldest (small) goes
    assert unregistered == [small[0].untyped_storage().data_ptr()] and len(registered) == 2
    assert locked == [False]  # its device synchronize does not hold up the pool's other users
    assert pool.free_bytes == size_class(256 * 128 * 4) and pool.lent_bytes == 0
    pool.close()
    assert sorted(unregistered) == sorted(registered)  # the rest at close, none twice


def test_a_pinned_block_made_while_the_pool_closes_is_unregistered_and_one_given_back_after_is_not(monkeypatch):
    """A block registered as close ran (close never saw it) is unregistered; one given back after close is not twice."""
    unregistered = []
    pool = BufferPool(keep_bytes=4096, pin=True)  # the block given back is dropped: over keep_bytes
    monkeypatch.setattr(buffer_pool, "_register", lambda block: pool.close())  # close runs during the registration
    monkeypatch.setattr(buffer_pool, "_unpin_all", lambda blocks: unregistered.extend(b.data_ptr() for b in blocks))
    sample = pool.take([((64, 128), torch.float32)])
    assert unregistered == [sample[0].untyped_storage().data_ptr()]
    pool.give_back(sample)  # after close: close's unregistering covered it (here: the line above), never again
    assert len(unregistered) == 1


def test_a_pinned_pool_faults_a_new_block_in_before_registering_it(monkeypatch):
    """A new pinned block is touched, then registered (the driver pins present pages); a reused one neither."""
    events = []
    monkeypatch.setattr(buffer_pool, "touch", lambda block: events.append(("touch", block.data_ptr(), block.numel())))
    monkeypatch.setattr(buffer_pool, "_register", lambda block: events.append(("register", block.data_ptr())))
    monkeypatch.setattr(buffer_pool, "_unpin_all", lambda blocks: None)
    pool = BufferPool(pin=True)
    sample = pool.take([((64, 128), torch.float32)])
    ptr = sample[0].untyped_storage().data_ptr()
    assert events == [("touch", ptr, size_class(64 * 128 * 4)), ("register", ptr)]  # the whole block, then pinned
    pool.give_back(sample)
    pool.take([((64, 128), torch.float32)])
    assert len(events) == 2  # reused: already present and pinned
    pool.close()


class _Cudart:
    """The CUDA runtime's unregister, failing for the pointers in ``refuse`` (error 713: not registered)."""

    def __init__(self, refuse=()):
        self.refuse, self.unregistered = set(refuse), []

    def cudaHostUnregister(self, ptr):
        if ptr in self.refuse:
            return 713
        self.unregistered.append(ptr)
        return 0


def test_a_pinned_block_not_unregistered_is_never_freed(monkeypatch):
    """A block whose device synchronize or unregistering fails stays allocated (STRANDED), never back to malloc."""
    monkeypatch.setattr(buffer_pool, "STRANDED", [])
    blocks = [torch.empty(4096, dtype=torch.uint8) for _ in range(3)]
    ptrs = [b.data_ptr() for b in blocks]

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        buffer_pool._unpin_all(blocks[:2])
    assert [b.data_ptr() for b in buffer_pool.STRANDED] == ptrs[:2]  # a copy may still land in them: kept

    cudart = _Cudart(refuse={ptrs[2]})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffer_pool.STRANDED.clear()
    with pytest.raises(RuntimeError, match=r"cudaHostUnregister failed for 1 sample blocks .*stays allocated"):
        buffer_pool._unpin_all(blocks[1:])
    assert cudart.unregistered == [ptrs[1]]  # every block tried, the first failure raised after
    assert [b.data_ptr() for b in buffer_pool.STRANDED] == [ptrs[2]]  # the driver still holds it: kept


def test_a_failed_unregister_at_close_still_closes_and_strands_the_blocks(monkeypatch):
    """close() whose unregistering fails still drops its free blocks and closes every memfd; the blocks are kept."""
    monkeypatch.setattr(buffer_pool, "STRANDED", [])
    monkeypatch.setattr(buffer_pool, "_register", lambda block: None)
    monkeypatch.setattr(buffer_pool, "touch", lambda block: None)

    def broken():
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    pool = BufferPool(keep_bytes=1 << 20, shared=True, pin=True)
    kept, given = pool.take([((64, 128), torch.float32)]), pool.take([((64, 128), torch.float32)])
    pool.give_back(given)
    fds = [fd for _, fd in pool._descriptors.values()]
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        pool.close()
    assert pool.free_bytes == 0 and pool._descriptors == {}
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
    stranded = {b.data_ptr() for b in buffer_pool.STRANDED}
    assert {kept[0].untyped_storage().data_ptr(), given[0].untyped_storage().data_ptr()} == stranded


def test_an_unregister_that_raises_strands_the_blocks_not_tried(monkeypatch):
    """A CUDA runtime call that raises mid-way (not an error code) keeps that block and the rest, all registered."""
    monkeypatch.setattr(buffer_pool, "STRANDED", [])
    blocks = [torch.empty(4096, dtype=torch.uint8) for _ in range(3)]
    cudart = _Cudart()

    def unregister(ptr):
        if ptr == blocks[1].data_ptr():
            raise KeyboardInterrupt
        return cudart.cudaHostUnregister(ptr)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: type("Rt", (), {"cudaHostUnregister": staticmethod(unregister)}))
    with pytest.raises(KeyboardInterrupt):
        buffer_pool._unpin_all(blocks)
    assert cudart.unregistered == [blocks[0].data_ptr()]
    assert [b.data_ptr() for b in buffer_pool.STRANDED] == [b.data_ptr() for b in blocks[1:]]


def test_a_pinned_pool_dropped_without_close_strands_its_blocks(monkeypatch):
    """A pinned pool garbage-collected unclosed keeps its blocks (never freed while registered); a closed one not."""
    monkeypatch.setattr(buffer_pool, "STRANDED", [])
    monkeypatch.setattr(buffer_pool, "_register", lambda block: None)
    monkeypatch.setattr(buffer_pool, "touch", lambda block: None)
    monkeypatch.setattr(buffer_pool, "_unpin_all", lambda blocks: None)
    pool = BufferPool(keep_bytes=1 << 20, pin=True)
    lent, given = pool.take([((64, 128), torch.float32)]), pool.take([((64, 128), torch.float32)])
    pool.give_back(given)
    ptrs = {lent[0].untyped_storage().data_ptr(), given[0].untyped_storage().data_ptr()}
    del pool
    gc.collect()
    assert {b.data_ptr() for b in buffer_pool.STRANDED} == ptrs
    closed = BufferPool(pin=True)
    closed.take([((64, 128), torch.float32)])
    closed.close()
    del closed
    gc.collect()
    assert len(buffer_pool.STRANDED) == 2  # close unregistered its block: nothing more kept
