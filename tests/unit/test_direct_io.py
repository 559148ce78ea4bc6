"""Direct writes: the same bytes as a buffered write from any memory, from the callers' memory where it is placed so."""

import ctypes
import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.direct import TAKE_DIRECT, fs_type, takes_direct, writer_goes_direct
from helpers.shm import private_shm
from speculators_v016.engine.buffer_pool import BufferPool
from speculators_v016.fp8 import CODE_DTYPE, SCALE_DTYPE, Fp8States
from speculators_v016.store import checksum, direct_io
from speculators_v016.store.atomic_files import ChunkRefused, write_durable
from speculators_v016.store.direct_io import ALIGN, BOUNCE_BYTES
from speculators_v016.store.sample_format import DATA_ALIGN, encode_typed, load_sample
from speculators_v016.store.writer import SampleWriter


def aligned(size: int, shift: int = 0) -> np.ndarray:
    """``size`` random bytes whose first lies ``shift`` bytes past a multiple of ALIGN."""
    raw = np.random.default_rng(size + shift).integers(0, 256, size + 2 * ALIGN, dtype=np.uint8)
    start = (shift - raw.ctypes.data) % ALIGN
    return raw[start : start + size]


def layouts():
    """Parts in file order: placed for direct writes, misplaced, tiny, empty, larger than the bounce buffer."""
    placed = [b"h" * ALIGN, aligned(3 * ALIGN), aligned(5 * ALIGN + 100), aligned(ALIGN, shift=100)]
    return {
        "placed": placed,
        "misplaced": [b"header", aligned(3 * ALIGN + 7, shift=1), aligned(100, shift=3)],
        "tiny": [b"a", b"", b"bc", aligned(5, shift=9)],
        "large misplaced": [aligned(BOUNCE_BYTES * 2 + 123, shift=64), b"tail"],
        "whole blocks": [aligned(4 * ALIGN)],
        "empty": [],
    }


@pytest.mark.parametrize("name", sorted(layouts()))
def test_direct_writes_the_same_bytes_as_a_buffered_write(tmp_path, name):
    """Each layout: the file's bytes, size and digest are those of the parts joined, whichever way they went."""
    parts = layouts()[name]
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    paths: dict = {}
    size, digest = write_durable(tmp_path, "f", parts, direct=paths, drop_cache=True)
    assert (tmp_path / "f").read_bytes() == joined and size == len(joined)
    assert digest == checksum.of_bytes(joined, "blake3") == checksum.of_file(tmp_path / "f", "blake3")
    assert sum(paths.values()) == len(joined)
    if takes_direct(tmp_path):
        assert paths.get("buffered", 0) == 0
        if name == "placed":  # the placed parts' whole blocks from their own memory
            assert paths["direct"] == 3 * ALIGN + 5 * ALIGN and paths["bounced"] == len(joined) - paths["direct"]
        if name in ("misplaced", "tiny", "large misplaced"):
            assert paths.get("direct", 0) == 0


def test_the_file_systems_that_take_direct_writes_are_used_so(tmp_path):
    """On ext4, xfs or btrfs the probe finds O_DIRECT taken (where not, every direct test here would pass vacuously)."""
    if fs_type(tmp_path) not in TAKE_DIRECT:
        pytest.skip(f"the test folder is on {fs_type(tmp_path) or 'an unknown file system'}")
    assert takes_direct(tmp_path)


def test_a_refused_direct_write_starts_the_file_over_buffered(tmp_path, monkeypatch):
    """EINVAL from a direct write (a file system that takes the flag but not the write): same file, fresh digest."""
    parts = layouts()["placed"]
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    calls = []

    def refusing(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 2:  # after a first block went out: the rewrite must not keep it twice
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.pwrite(fd, buffers[0], offset)  # a short write: the first buffer only

    monkeypatch.setattr(direct_io.os, "pwritev", refusing)
    monkeypatch.setattr(direct_io, "enable", lambda fd: True)
    paths: dict = {}
    size, digest = write_durable(tmp_path, "f", parts, direct=paths)
    assert len(calls) == 2 and paths == {"refused": 1, "buffered": len(joined)}
    assert (tmp_path / "f").read_bytes() == joined and size == len(joined)
    assert digest == checksum.of_bytes(joined, "blake3")


def test_a_short_unaligned_direct_write_is_refused(tmp_path, monkeypatch):
    """A direct write that wrote part of a block cannot go on aligned: refused, the file written buffered."""
    parts = layouts()["whole blocks"]
    monkeypatch.setattr(direct_io.os, "pwritev", lambda fd, buffers, offset: os.write(fd, bytes(buffers[0][:100])))
    monkeypatch.setattr(direct_io, "enable", lambda fd: True)
    paths: dict = {}
    write_durable(tmp_path, "f", parts, direct=paths)
    assert paths == {"refused": 1, "buffered": 4 * ALIGN} and (tmp_path / "f").read_bytes() == parts[0].tobytes()


def test_a_placed_file_goes_out_in_one_write_call(tmp_path, monkeypatch):
    """Header, tensors and joints of a placed file leave in one pwritev: one trip through the GIL, not one a part."""
    if not takes_direct(tmp_path):
        pytest.skip("the test folder's file system refuses O_DIRECT")
    calls = []
    real = os.pwritev
    monkeypatch.setattr(
        direct_io.os, "pwritev", lambda fd, buffers, offset: calls.append(len(buffers)) or real(fd, buffers, offset)
    )
    parts = layouts()["placed"]
    write_durable(tmp_path, "f", parts, direct={})
    assert len(calls) == 1 and calls[0] >= 3
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(memoryview(p).cast("B")) for p in parts)


@pytest.mark.parametrize("queue_limit", [2, 1024])
@pytest.mark.parametrize("name", sorted(layouts()))
def test_short_aligned_direct_writes_go_on_where_they_stopped(tmp_path, monkeypatch, name, queue_limit):
    """A kernel that writes one block a call (and a queue that fills at two buffers): the same bytes, in order."""
    calls = []

    def one_block(fd, buffers, offset):
        calls.append(offset)
        return os.pwrite(fd, bytes(memoryview(buffers[0]).cast("B")[:ALIGN]), offset)

    monkeypatch.setattr(direct_io.os, "pwritev", one_block)
    monkeypatch.setattr(direct_io, "enable", lambda fd: True)  # the fake writes buffered: any file system
    monkeypatch.setattr(direct_io, "_IOV_MAX", queue_limit)
    parts = layouts()[name]
    joined = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    paths: dict = {}
    size, digest = write_durable(tmp_path, "f", parts, direct=paths)
    assert (tmp_path / "f").read_bytes() == joined and size == len(joined) and "buffered" not in paths
    assert calls == [ALIGN * k for k in range(-(-len(joined) // ALIGN))]
    assert digest == checksum.of_bytes(joined, "blake3")


def test_a_file_system_refusing_the_flag_gets_buffered_writes(tmp_path, monkeypatch):
    """fcntl refusing O_DIRECT: the file is written through the page cache and says so."""

    def refuse(fd, command, *args):
        if command == direct_io.fcntl.F_SETFL and args and args[0] & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, command, *args)

    real = direct_io.fcntl.fcntl
    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse)
    paths: dict = {}
    write_durable(tmp_path, "f", layouts()["placed"], direct=paths)
    assert set(paths) == {"buffered"}


def test_a_scan_refusing_a_chunk_leaves_no_file_when_direct(tmp_path):
    """A refused chunk stops a direct write as it stops a buffered one: no file under either name."""
    with pytest.raises(ChunkRefused):
        write_durable(tmp_path, "f", layouts()["placed"], direct={}, scans=[None, None, lambda c: False, None])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize(("tokens", "hidden", "dtype", "fp8"), [(512, 7168, torch.bfloat16, False),
                         (37, 896, torch.bfloat16, False), (29, 1024, torch.float32, False), (33, 7168, None, True)])  # fmt: skip
def test_a_pooled_sample_goes_to_disk_from_its_own_memory(tmp_path, fresh, tokens, hidden, dtype, fp8):
    """The pool's placement and the file layout agree: every whole block of the states is written without a copy."""
    pool = BufferPool(fresh_below=1 << 40 if fresh else 0, align=DATA_ALIGN)
    layers = 3
    if fp8:
        tensors = pool.take([((tokens, hidden), CODE_DTYPE)] * layers + [((tokens,), SCALE_DTYPE)] * layers)
        for t in tensors:
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, dtype=torch.uint8))
        states = [Fp8States(c, s) for c, s in zip(tensors[:layers], tensors[layers:])]
    else:
        states = pool.take([((tokens, hidden), dtype)] * layers)
        for s in states:
            s.copy_(torch.randn(tokens, hidden))
    sample = {
        "input_ids": torch.arange(tokens),
        "loss_mask": torch.ones(tokens, dtype=torch.int64),
        "hidden_states": states,
    }
    parts, _ = encode_typed(sample, "safetensors", [1, 2, 3])
    assert len(parts[0]) % DATA_ALIGN == 0  # the header padded: the data starts on a block
    paths: dict = {}
    size, _ = write_durable(tmp_path, "data_0.safetensors", parts, direct=paths)
    back = load_sample(tmp_path / "data_0.safetensors", dequantize_to=None)
    assert torch.equal(back["input_ids"], sample["input_ids"]) and torch.equal(back["loss_mask"], sample["loss_mask"])
    for got, want in zip(back["hidden_states"], states):
        if fp8:
            assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
            assert torch.equal(got.scales, want.scales)
        else:
            assert torch.equal(got, want)
    if takes_direct(tmp_path):
        state_bytes = sum(p.nbytes for p in parts[1 : 1 + layers])
        assert paths["direct"] >= state_bytes - layers * 2 * ALIGN  # at most the blocks where tensors meet copied
        assert paths["direct"] + paths["bounced"] == size


def test_direct_writes_hold_no_page_cache_copy(tmp_path):
    """The point of it: a direct file's pages are not in the page cache (no kernel copy was made), a buffered one's are."""
    if not takes_direct(tmp_path) or fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("no O_DIRECT here, or a file system whose files live in the page cache")
    data = aligned(64 * ALIGN)
    write_durable(tmp_path, "direct", [data], direct={})
    write_durable(tmp_path, "buffered", [data])
    assert resident_pages(tmp_path / "direct") == 0
    assert resident_pages(tmp_path / "buffered") == 64


def resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore(2) of a read-only mapping)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view  # the mapping closes only without exported buffers
    if failed:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("direct", [True, False])
def test_the_writer_says_how_its_bytes_went(tmp_path, direct):
    """SampleWriter(direct=...): pooled samples go from their memory (where taken), --no-direct-io through the page
    cache; load() counts the bytes each way, all of them, and the files read back the same either way."""
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, direct=direct)
    states = _write_pooled(writer, 4)
    load = writer.load()
    assert load["direct"] + load["bounced"] + load["buffered"] == writer.bytes
    if not direct:
        assert load["buffered"] == writer.bytes
    elif writer_goes_direct(tmp_path):
        assert load["buffered"] == 0 and load["direct"] > 0.9 * writer.bytes
    _read_back(tmp_path, states)


def test_in_memory_names_the_file_systems_whose_files_are_pages(tmp_path):
    """in_memory() agrees with /proc/mounts: tmpfs (a folder under /dev/shm) is named, the test folder's disk is not."""
    with private_shm() as shm:
        assert fs_type(shm) == "tmpfs" and direct_io.in_memory(shm) == "tmpfs"
    kind = fs_type(tmp_path)
    assert direct_io.in_memory(tmp_path) == (kind if kind in ("tmpfs", "ramfs") else None)
    assert direct_io.in_memory(tmp_path / "absent") is None  # statfs fails: not known, so not in memory


def test_a_writer_into_tmpfs_goes_through_the_page_cache_and_says_why(tmp_path):
    """On tmpfs a direct write is the same kernel copy, after the hash read the bytes: the writer goes buffered there
    (each chunk copied, then hashed from the cache), every file reads back, and the host line names the folder's
    file system."""
    from speculators_v016.run.pipeline import _paths  # noqa: PLC0415 - the run's module only for its host line

    with private_shm() as shm:
        writer = SampleWriter(Path(shm), "safetensors", [1, 2], workers=2, direct=True)
        assert writer.in_memory == "tmpfs" and writer.direct is False
        states = _write_pooled(writer, 3)
        load = writer.load()
        assert load["buffered"] == writer.bytes > 0 and load["direct"] == load["bounced"] == 0
        assert load["in_memory"] == "tmpfs"
        assert "100.0% through the page cache (the folder is on tmpfs, whose files are memory pages" in _paths(load)
        _read_back(Path(shm), states)
    disk = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, direct=True)
    disk.close()
    assert disk.in_memory == direct_io.in_memory(tmp_path) and disk.direct is (disk.in_memory is None)


def _write_pooled(writer: SampleWriter, count: int) -> list:
    """``count`` samples of two pooled bf16 layers of 300 rows put to ``writer``, which is closed; their states."""
    pool = BufferPool(align=DATA_ALIGN)
    states = []
    for i in range(count):
        layers = pool.take([((300, 1024), torch.bfloat16)] * 2)
        for layer in layers:
            layer.copy_(torch.randn(300, 1024))
        states.append(layers)
        writer.put(i, {"input_ids": torch.arange(300), "loss_mask": torch.ones(300, dtype=torch.int64),
                       "hidden_states": layers})  # fmt: skip
    writer.close()
    return states


def _read_back(folder, states: list) -> None:
    """Every sample file in ``folder`` holds the states it was written from."""
    for i, layers in enumerate(states):
        back = load_sample(folder / f"data_{i}.safetensors")
        assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], layers))


def test_a_writer_stops_asking_after_a_refused_direct_write(tmp_path, monkeypatch):
    """A file system that takes the flag but refuses the write: that file is rewritten buffered, later ones never
    try O_DIRECT again, every file reads back, and load() and the host line say so."""
    from speculators_v016.run.pipeline import _paths  # noqa: PLC0415 - the run's module only for its host line

    enabled = []

    def refusing(fd, buffers, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io.os, "pwritev", refusing)
    monkeypatch.setattr(direct_io, "enable", lambda fd: enabled.append(fd) or True)
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, direct=True)
    states = _write_pooled(writer, 3)
    load = writer.load()
    assert len(enabled) == 1 and load["refused"] == 1 and writer.direct is False
    assert load["buffered"] == writer.bytes and load["direct"] == load["bounced"] == 0
    assert "refused a direct write" in _paths(load)
    _read_back(tmp_path, states)
