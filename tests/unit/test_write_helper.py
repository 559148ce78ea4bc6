"""Write helpers: sample files written by child processes from the pool's shared blocks (real processes, files)."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time

import blake3
import pytest
import torch

from helpers.direct import writer_goes_direct
from speculators_v016.checks.finite import non_finite_reason
from speculators_v016.engine.buffer_pool import BufferPool
from speculators_v016.fp8 import Fp8States, quantize_into
from speculators_v016.store.atomic_files import WriteError
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.no_links import LinkedEntryError
from speculators_v016.store.sample_format import DATA_ALIGN, load_sample
from speculators_v016.store.writer import SampleWriter, WriterThreadError

LAYERS = [2, 5, 9]


def pooled(pool, index, tokens, hidden=256, fp8=False, nan_at=None):
    """A sample whose states lie in one of ``pool``'s blocks (FP8: codes then scales), as the engine lays them."""
    g = torch.Generator().manual_seed(index)
    rows = [torch.randn(tokens, hidden, generator=g, dtype=torch.float32) for _ in LAYERS]
    if nan_at is not None:
        rows[nan_at][tokens // 2, 3] = float("nan")
    if fp8:
        specs = [((tokens, hidden), torch.float8_e4m3fn)] * len(LAYERS) + [((tokens,), torch.float32)] * len(LAYERS)
        block = pool.take(specs)
        states = [Fp8States(block[j], block[len(LAYERS) + j]) for j in range(len(LAYERS))]
        for r, s in zip(rows, states):
            quantize_into(r, s.codes, s.scales)
    else:
        block = pool.take([((tokens, hidden), torch.bfloat16)] * len(LAYERS))
        for r, t in zip(rows, block):
            t.copy_(r)
        states = block
    sample = {"input_ids": torch.arange(tokens) + index, "loss_mask": torch.ones(tokens, dtype=torch.long),
              "hidden_states": states}  # fmt: skip
    return sample, block


def write_all(folder, samples, helpers, pool, **options):
    writer = SampleWriter(folder, "safetensors", LAYERS, workers=2, non_finite=non_finite_reason(LAYERS),
                          shared_blocks=pool if helpers else None, **options)  # fmt: skip
    for index, (sample, block) in samples:
        writer.put(index, sample, done=lambda b=block: pool.give_back(b))
    writer.close()
    return writer


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_helper_files_are_the_threads_files_bit_for_bit(tmp_path, fp8, direct):
    """The same samples through helpers and through the threads: identical files, digests and manifest lines."""
    files = {}
    for helpers in (True, False):
        pool = BufferPool(align=DATA_ALIGN, shared=True)
        folder = tmp_path / f"helpers-{helpers}"
        folder.mkdir()
        samples = [(i, pooled(pool, i, 50 + 61 * i, fp8=fp8)) for i in range(8)]
        writer = write_all(folder, samples, helpers, pool, direct=direct)
        assert writer.helped == (8 if helpers else 0)
        entries = Manifest(folder).entries()
        assert sorted(entries) == list(range(8))
        files[helpers] = {i: ((folder / e.file).read_bytes(), e.digest, e.bytes) for i, e in entries.items()}
        for i, e in entries.items():
            assert blake3.blake3(files[helpers][i][0]).hexdigest() == e.digest
        pool.close()
    assert files[True] == files[False]
    back = load_sample(tmp_path / "helpers-True" / "data_3.safetensors")
    assert torch.equal(back["input_ids"], torch.arange(50 + 61 * 3) + 3)


@pytest.mark.parametrize("tokens", [3000, 5], ids=["6-MiB-layers", "tiny-layers"])
def test_states_outside_the_blocks_are_written_by_their_thread(tmp_path, tokens):
    """States in fresh memory (a CPU engine's), large or tiny: the thread writes that file itself, from there."""
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    inside = [(i, pooled(pool, i, 40)) for i in range(3)]
    fresh = BufferPool(align=DATA_ALIGN, fresh_below=1 << 40).take([((tokens, 1024), torch.bfloat16)] * 3)
    for layer in fresh:
        layer.copy_(torch.randn(tokens, 1024))
    outside = {"input_ids": torch.arange(tokens), "loss_mask": torch.ones(tokens, dtype=torch.long),
               "hidden_states": fresh}  # fmt: skip
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1, shared_blocks=pool)
    for index, (sample, block) in inside:
        writer.put(index, sample, done=lambda b=block: pool.give_back(b))
    writer.put(3, outside)
    writer.close()
    assert writer.helped == 3 and len(Manifest(tmp_path).entries()) == 4
    assert torch.equal(load_sample(tmp_path / "data_3.safetensors")["hidden_states"][2], fresh[2])
    if writer_goes_direct(tmp_path):  # the fresh states went from their own memory, not copied through a socket
        assert writer.paths["direct"] >= 3 * tokens * 1024 * 2 - 3 * 4096


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_nan_found_by_the_helper_refuses_the_sample_naming_its_layer(tmp_path, fp8):
    """A NaN in layer 5 of sample 2: the helper's chunk test refuses it, no file is left, the reason names layer 5."""
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    samples = [(i, pooled(pool, i, 70, fp8=fp8, nan_at=1 if i == 2 else None)) for i in range(4)]
    writer = write_all(tmp_path, samples, True, pool)
    assert writer.take_rejected() == [(2, ([5], 70))]
    assert sorted(Manifest(tmp_path).entries()) == [0, 1, 3]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("data_")) == [
        "data_0.safetensors", "data_1.safetensors", "data_3.safetensors"]  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_link_at_the_helpers_temporary_name_is_refused_and_left(tmp_path):
    """A link planted under the helper's next temporary name: LinkedEntryError naming it; the target untouched."""
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1, shared_blocks=pool)
    sample, block = pooled(pool, 0, 30)
    writer.put(0, sample, done=lambda b=block: pool.give_back(b))
    while writer.helped < 1:
        time.sleep(0.01)
    pid = writer._helpers[0].process.pid
    target = tmp_path.parent / "elsewhere.txt"
    target.write_text("not yours")
    (tmp_path / f".tmp-data_1.safetensors.{pid}").symlink_to(target)
    sample, block = pooled(pool, 1, 30)
    writer.put(1, sample, done=lambda b=block: pool.give_back(b))
    with pytest.raises(LinkedEntryError, match=r"\.tmp-data_1\.safetensors\.\d+: a symbolic link"):
        writer.close()
    assert target.read_text() == "not yours" and (tmp_path / f".tmp-data_1.safetensors.{pid}").is_symlink()
    assert sorted(Manifest(tmp_path).entries()) == [0]


def test_a_write_the_helper_cannot_make_is_a_write_error_naming_the_file(tmp_path):
    """The helper's file size limit (inherited) refuses a write: WriteError naming the file, nothing left of it."""
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1, shared_blocks=pool)
    sample, block = pooled(pool, 0, 2000, hidden=512)  # 6 MiB of states
    before_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    before_signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, before_limit[1]))
    try:
        writer.put(0, sample, done=lambda b=block: pool.give_back(b))
        while writer.helped == 0 and writer.error is None:  # the helper starts (and takes the limit) here
            time.sleep(0.01)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before_limit)
        signal.signal(signal.SIGXFSZ, before_signal)
    with pytest.raises(WriteError, match=r"cannot write .*data_0\.safetensors: File too large") as caught:
        writer.close()
    assert caught.value.errno == errno.EFBIG
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", "data_"))]


def test_a_helper_killed_stops_the_run_and_keeps_what_was_listed(tmp_path):
    """SIGKILL to a helper: the next put or close raises WriterThreadError naming it; listed files stay whole."""
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1, shared_blocks=pool, commit_interval=0.01)
    sample, block = pooled(pool, 0, 30)
    writer.put(0, sample, done=lambda b=block: pool.give_back(b))
    while writer.written < 1:
        time.sleep(0.01)
    helper = writer._helpers[0].process
    os.kill(helper.pid, signal.SIGKILL)
    helper.wait()
    with pytest.raises(WriterThreadError, match=r"write helper process \(pid \d+\) is gone: .*exit status -9"):
        for i in range(1, 20):
            sample, block = pooled(pool, i, 30)
            writer.put(i, sample, done=lambda b=block: pool.give_back(b))
        writer.close()
    entries = Manifest(tmp_path).entries()
    assert 0 in entries
    for entry in entries.values():
        assert blake3.blake3((tmp_path / entry.file).read_bytes()).hexdigest() == entry.digest


def test_helpers_unmap_the_blocks_the_pool_dropped(tmp_path):
    """A pool that keeps little: each request tells the helper which blocks are gone; it maps only live ones."""
    pool = BufferPool(align=DATA_ALIGN, shared=True, keep_bytes=1 << 20)
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1, shared_blocks=pool)
    for i in range(12):
        sample, block = pooled(pool, i, 100 + 150 * (i % 4))
        live = pool.live()  # what the request will see: this sample's block included
        writer.put(i, sample, done=lambda b=block: pool.give_back(b))
        writer.queue.join()
        helper = writer._helpers[0]
        assert helper.known <= live
        maps = [x for x in open(f"/proc/{helper.process.pid}/maps") if "speculators-sample-block" in x]
        assert len(maps) == len(helper.known)
    writer.close()
    assert pool.allocated > 4 and len(Manifest(tmp_path).entries()) == 12


def test_shared_blocks_are_memfds_and_locate_finds_only_their_bytes():
    """take() from a shared pool: memfd memory; locate() names block and offset inside it, None outside."""
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    a, b = pool.take([((10, 64), torch.bfloat16), ((10,), torch.int64)])
    block, fd, size, offset = pool.locate(a.data_ptr(), a.numel() * 2)
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:speculators-sample-block")
    assert offset % DATA_ALIGN == 0 and size >= a.numel() * 2 + b.numel() * 8 and block in pool.live()
    assert pool.locate(b.data_ptr(), b.numel() * 8)[3] == offset + a.numel() * 2
    assert pool.locate(torch.zeros(4).data_ptr(), 16) is None
    assert pool.locate(a.data_ptr(), size + 1) is None  # runs past the block
    assert BufferPool(align=DATA_ALIGN).locate(a.data_ptr(), 4) is None
    pool.give_back([a, b])
    pool.close()
    assert pool.live() == set()


def test_the_helper_program_imports_no_torch():
    """The helper's own imports (its module, the store, the NaN test's table) leave torch and vLLM out."""
    code = textwrap.dedent("""
        import sys
        import speculators_v016.store.write_helper, speculators_v016.store.atomic_files
        import speculators_v016.checks.finite_bits
        print(sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == []


def test_a_helper_runs_its_parents_code_not_a_package_in_the_working_folder(tmp_path, monkeypatch):
    """A run started in a folder holding another speculators_v016 (a checkout): its helpers still run this one."""
    decoy = tmp_path / "cwd" / "speculators_v016" / "store"
    decoy.mkdir(parents=True)
    for init in (decoy / "__init__.py", decoy.parent / "__init__.py"):
        init.write_text("")
    (decoy / "write_helper.py").write_text("raise SystemExit('the working folder's write helper ran')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    out = tmp_path / "out"
    out.mkdir()
    pool = BufferPool(align=DATA_ALIGN, shared=True)
    writer = SampleWriter(out, "safetensors", LAYERS, workers=1, shared_blocks=pool)
    sample, block = pooled(pool, 0, 40)
    writer.put(0, sample, done=lambda b=block: pool.give_back(b))
    writer.close()
    assert writer.helped == 1 and sorted(Manifest(out).entries()) == [0]


def test_helpers_end_with_a_killed_parent(tmp_path):
    """The writing process SIGKILLed mid-run: its helpers exit; listed files are whole, no temporary file grows."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path[:0] = [{str(os.path.dirname(__file__))!r}, {str(os.path.dirname(os.path.dirname(__file__)))!r}]
        from test_write_helper import pooled, LAYERS
        from speculators_v016.engine.buffer_pool import BufferPool
        from speculators_v016.store.sample_format import DATA_ALIGN
        from speculators_v016.store.writer import SampleWriter
        pool = BufferPool(align=DATA_ALIGN, shared=True)
        writer = SampleWriter({str(tmp_path)!r}, "safetensors", LAYERS, workers=2, shared_blocks=pool,
                              commit_interval=0.01)
        i, said = 0, False
        while True:
            sample, block = pooled(pool, i, 400)
            writer.put(i, sample, done=lambda b=block: pool.give_back(b))
            if not said and writer.written >= 2:  # files listed, more being written
                print(*[h.process.pid for h in writer._helpers if h], flush=True)
                said = True
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids, "no helper started"
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a helper outlived its writer"
    entries = Manifest(tmp_path).entries()
    assert entries, "nothing was listed before the kill"
    for entry in entries.values():
        assert blake3.blake3((tmp_path / entry.file).read_bytes()).hexdigest() == entry.digest
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir() if p.name.startswith(".tmp-")}
    time.sleep(0.2)
    assert sizes == {p.name: p.stat().st_size for p in tmp_path.iterdir() if p.name.startswith(".tmp-")}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
