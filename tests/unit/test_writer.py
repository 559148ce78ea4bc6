"""The sample writer: workers, rejection, group commit order, errors (real files in a temp folder)."""

import errno
import os
import threading
import time

import blake3
import pytest
import torch

from speculators_v016.checks import finite
from speculators_v016.checks.finite import non_finite
from speculators_v016.config import WRITER_NICE_INCREMENT
from speculators_v016.fp8 import Fp8States, quantize
from speculators_v016.run.run_report import exit_code
from speculators_v016.store import atomic_files, group_commit
from speculators_v016.store.atomic_files import WriteError
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.store.writer import SampleWriter, WriterThreadError


def sample(index, tokens=6, hidden=4, layers=2):
    return {
        "input_ids": torch.arange(tokens) + index,
        "loss_mask": torch.ones(tokens, dtype=torch.long),
        "hidden_states": [torch.full((tokens, hidden), float(index + j), dtype=torch.bfloat16) for j in range(layers)],
    }


def test_every_sample_is_written_listed_and_hashed(tmp_path):
    """N samples through 3 workers: N files, N manifest lines whose sizes and BLAKE3 digests match the bytes."""
    done = []
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=3)
    for i in range(20):
        writer.put(i, sample(i), done=lambda i=i: done.append(i))
    writer.close()
    entries = Manifest(tmp_path).entries()
    assert sorted(entries) == list(range(20)) and sorted(done) == list(range(20))
    for i, entry in entries.items():
        data = (tmp_path / entry.file).read_bytes()
        assert len(data) == entry.bytes and entry.algorithm == "blake3"
        assert blake3.blake3(data).hexdigest() == entry.digest
        assert torch.equal(load_sample(tmp_path / entry.file)["hidden_states"][1], sample(i)["hidden_states"][1])
    assert (writer.written, writer.bytes) == (20, sum(e.bytes for e in entries.values()))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_close_adds_threads_for_the_samples_still_queued(tmp_path):
    """close(drain_workers=3): with the one worker held, 3 more threads write the queued samples, the same bytes."""
    release = threading.Event()
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1)
    writer.put(0, sample(0), done=lambda: release.wait(60))  # the worker holds here once sample 0 is written
    for i in range(1, 6):
        writer.put(i, sample(i))
    closing = threading.Thread(target=writer.close, kwargs={"drain_workers": 3})
    closing.start()
    deadline = time.monotonic() + 20  # well before the worker would go on by itself
    while len(list(tmp_path.glob("data_*.safetensors"))) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    written_while_held = sorted(p.name for p in tmp_path.glob("data_*.safetensors"))
    release.set()
    closing.join(60)
    assert len(written_while_held) == 6, written_while_held  # 1..5 by the added threads alone
    load = writer.load()
    assert (load["workers"], load["drainers"]) == (1, 3)
    reference = tmp_path / "reference"
    reference.mkdir()
    alone = SampleWriter(reference, "safetensors", [1, 2], workers=1)
    for i in range(6):
        alone.put(i, sample(i))
    alone.close(drain_workers=3)  # nothing queued by then, or a few: the same files either way
    for i, entry in Manifest(tmp_path).entries().items():
        assert (tmp_path / entry.file).read_bytes() == (reference / entry.file).read_bytes(), i


def test_close_adds_no_thread_for_an_empty_queue(tmp_path):
    """With nothing queued, close(drain_workers=4) adds no thread."""
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2)
    writer.put(0, sample(0))
    while writer.queue.qsize():
        time.sleep(0.01)
    writer.close(drain_workers=4)
    assert writer.load()["drainers"] == 0 and len(Manifest(tmp_path).entries()) == 1


def test_commits_are_grouped(tmp_path):
    """With a long commit interval, 30 samples take at most 2 commits (2 fsyncs each), not 30."""
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, commit_interval=60)
    for i in range(30):
        writer.put(i, sample(i))
    writer.close()  # wakes the committer for the last batch at once
    assert writer.commit.commits <= 2 and len(Manifest(tmp_path).entries()) == 30


def test_a_line_is_appended_only_after_its_rename_is_durable(tmp_path, monkeypatch):
    """Order per sample: file fsynced and renamed, then a folder fsync, then its manifest line."""
    events, lock = [], threading.Lock()
    real_replace, real_fsync_dir, real_append = os.replace, group_commit.fsync_dir, Manifest.append

    def replace(src, dst):
        real_replace(src, dst)
        with lock:
            events.append(("rename", os.path.basename(dst)))

    def fsync_dir(directory):
        real_fsync_dir(directory)
        with lock:
            events.append(("fsync_dir", None))

    def append(self, *entries):
        with lock:
            events.extend(("line", e.file) for e in entries)
        real_append(self, *entries)

    monkeypatch.setattr(atomic_files.os, "replace", replace)
    monkeypatch.setattr(group_commit, "fsync_dir", fsync_dir)
    monkeypatch.setattr(Manifest, "append", append)
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, commit_interval=0.01)
    for i in range(12):
        writer.put(i, sample(i))
    writer.close()
    lines = [i for i, (kind, _) in enumerate(events) if kind == "line"]
    assert len(lines) == 12
    for at in lines:
        name = events[at][1]
        renamed = events.index(("rename", name))
        assert any(events[k][0] == "fsync_dir" for k in range(renamed + 1, at)), (name, events)


def test_rejected_samples_are_not_written_and_reported(tmp_path):
    """A sample the check refuses gets no file and no line, is reported once, and its memory is released."""
    done = []
    reject = lambda s: "bad" if int(s["input_ids"][0]) % 3 == 0 else None  # noqa: E731
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, reject=reject)
    for i in range(9):
        writer.put(i, sample(i), done=lambda i=i: done.append(i))
    writer.close()
    assert sorted(writer.take_rejected()) == [(0, "bad"), (3, "bad"), (6, "bad")] and writer.take_rejected() == []
    assert sorted(Manifest(tmp_path).entries()) == [1, 2, 4, 5, 7, 8]
    assert not (tmp_path / "data_3.safetensors").exists() and sorted(done) == list(range(9))


def test_a_write_error_stops_the_writer_naming_the_file(tmp_path, monkeypatch):
    """ENOSPC on a sample: close() raises WriteError naming it; files written before it stay listed."""
    real = atomic_files.write_parts

    def write_parts(fh, parts, digest, scans=None, sink=None):
        if "data_4" in fh.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fh, parts, digest, scans, sink)

    monkeypatch.setattr(atomic_files, "write_parts", write_parts)
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1)
    with pytest.raises(WriteError, match=r"cannot write .*data_4\.safetensors: No space left on device"):
        try:
            for i in range(8):
                writer.put(i, sample(i))
        finally:
            writer.close()  # as the pipeline does: what was written before the error is committed
    assert sorted(Manifest(tmp_path).entries()) == [0, 1, 2, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_workers_run_on_the_cpus_given(tmp_path):
    """Writer threads take the CPU set they are given, not the pin of the thread that made them."""
    seen = set()
    cpus = sorted(os.sched_getaffinity(0))
    writer = SampleWriter(
        tmp_path,
        "safetensors",
        [1, 2],
        workers=2,
        cpus=cpus[:1],
        reject=lambda s: seen.add(frozenset(os.sched_getaffinity(0))),
    )
    for i in range(4):
        writer.put(i, sample(i))
    writer.close()
    assert seen == {frozenset(cpus[:1])}


def test_workers_run_below_the_engine_and_drop_written_pages(tmp_path, monkeypatch):
    """Writer threads run WRITER_NICE_INCREMENT nice levels lower; each file's pages are dropped once fsynced."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen, dropped = set(), []
    real = os.posix_fadvise

    def advise(fd, offset, length, advice):  # records what the file held when it was advised
        dropped.append((os.fstat(fd).st_size, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    writer = SampleWriter(
        tmp_path,
        "safetensors",
        [1, 2],
        workers=2,
        reject=lambda s: seen.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())),
    )
    for i in range(4):
        writer.put(i, sample(i))
    writer.close()
    assert seen == {min(19, mine + WRITER_NICE_INCREMENT)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's thread is untouched
    sizes = sorted(e.bytes for e in Manifest(tmp_path).entries().values())
    assert sorted(dropped) == [(size, os.POSIX_FADV_DONTNEED) for size in sizes]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("batch", [True, False])
def test_workers_run_under_sched_batch_where_asked(tmp_path, batch):
    """batch=True: every writer thread runs under SCHED_BATCH at its lowered nice level, the caller's thread untouched."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = set()
    writer = SampleWriter(
        tmp_path,
        "safetensors",
        [1, 2],
        workers=2,
        batch=batch,
        reject=lambda s: seen.add(
            (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        ),
    )
    for i in range(4):
        writer.put(i, sample(i))
    writer.close()
    policy = os.SCHED_BATCH if batch else os.SCHED_OTHER
    assert seen == {(policy, min(19, mine + WRITER_NICE_INCREMENT))}
    assert writer.load()["batched"] == (2 if batch else 0)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is untouched


def test_a_refused_cache_drop_is_not_a_write_error(tmp_path, monkeypatch):
    """posix_fadvise failing (advice only) leaves the sample written and listed."""

    def refuse(*args):
        raise OSError(errno.EINVAL, "not supported here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1)
    writer.put(0, sample(0))
    writer.close()
    assert list(Manifest(tmp_path).entries()) == [0]


def _produce(writer, count, done=None):
    """Put ``count`` samples then close, in a thread; (error raised or None, seconds taken, whether it ended)."""
    outcome = {}

    def producer():
        started = time.monotonic()
        try:
            try:
                for i in range(count):
                    writer.put(i, sample(i), done=done)
            finally:
                writer.close()
        except BaseException as exc:  # noqa: BLE001 - what the producer sees is the result
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    thread.join(timeout=20)
    return outcome.get("error"), outcome.get("seconds"), not thread.is_alive()


def test_a_failing_done_callback_stops_the_run_within_seconds(tmp_path):
    """done() raising on a writer thread (a tensor not from the pool): put/close raise WriterThreadError, no hang."""

    def done():
        raise RuntimeError("these tensors were not taken from this pool, or were given back twice")

    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, bound=2)
    error, seconds, ended = _produce(writer, 40, done=done)
    assert ended and seconds < 5, "the producer hung"
    assert isinstance(error, WriterThreadError) and not isinstance(error, WriteError)
    assert "a sample-writer thread failed (RuntimeError: these tensors were not taken from this pool" in str(error)
    assert exit_code(error) == 5
    listed = Manifest(tmp_path).entries()
    for entry in listed.values():  # what was listed before the failure is complete
        assert (tmp_path / entry.file).stat().st_size == entry.bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_writer_threads_that_died_are_reported_not_waited_for(tmp_path, monkeypatch):
    """Every worker gone without an error (killed outside its guard): put raises WriterThreadError, no hang."""
    monkeypatch.setattr(SampleWriter, "_work", lambda self: None)  # the threads end at once, silently
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, bound=2)
    error, seconds, ended = _produce(writer, 10)
    assert ended and seconds < 5, "the producer hung"
    assert isinstance(error, WriterThreadError) and "every sample-writer thread has ended" in str(error)


def test_a_failing_reject_check_is_a_writer_thread_error(tmp_path):
    """reject() raising (not a disk error): WriterThreadError (exit 5), not WriteError (exit 6, disk full)."""

    def reject(s):
        raise TypeError("bad sample dict")

    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, reject=reject)
    error, seconds, ended = _produce(writer, 4)
    assert ended and isinstance(error, WriterThreadError) and "TypeError: bad sample dict" in str(error)
    assert exit_code(error) == 5 and Manifest(tmp_path).entries() == {}


def fp8_sample(index, tokens=6, hidden=8, layers=2):
    rows = [torch.linspace(-2, 2, tokens * hidden).reshape(tokens, hidden) + j for j in range(layers)]
    return {
        "input_ids": torch.arange(tokens) + index,
        "loss_mask": torch.ones(tokens, dtype=torch.long),
        "hidden_states": [Fp8States(*quantize(r)) for r in rows],
    }


def names_bad_layers(s):
    bad = non_finite(s["hidden_states"])
    return bad or None


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_samples_with_nan_are_refused_by_the_check_during_the_write(tmp_path, fmt, monkeypatch):
    """NaN/Inf at a layer's first or last value (chunks of 40 bytes): no file, no temp file, reason names the layer."""
    monkeypatch.setattr(atomic_files, "WRITE_CHUNK", 40)
    bad = {}
    for index, (layer, at, value) in enumerate([(0, 0, float("nan")), (1, -1, float("inf")), (1, 7, float("-inf"))]):
        s = sample(index, tokens=9, hidden=5)
        s["hidden_states"][layer].view(-1)[at] = value
        bad[index] = s
    writer = SampleWriter(tmp_path, fmt, [1, 2], workers=2, non_finite=names_bad_layers)
    for index, s in bad.items():
        writer.put(index, s)
    clean = {i: sample(i, tokens=9, hidden=5) for i in range(3, 6)}
    for index, s in clean.items():
        writer.put(index, s)
    writer.close()
    assert sorted(writer.take_rejected()) == [(0, [0]), (1, [1]), (2, [1])]
    assert sorted(Manifest(tmp_path).entries()) == [3, 4, 5]
    assert sorted(p.name for p in tmp_path.iterdir() if "data_" in p.name) == [
        f"data_{i}.{fmt}" for i in (3, 4, 5)
    ]  # nothing under a temporary name either
    for index, s in clean.items():
        got = load_sample(tmp_path / f"data_{index}.{fmt}")["hidden_states"]
        assert all(torch.equal(a, b) for a, b in zip(got, s["hidden_states"]))


def test_fp8_samples_with_a_nan_code_or_scale_are_refused(tmp_path, monkeypatch):
    """FP8 storage: a NaN e4m3 code or a NaN float32 scale refuses the sample; a clean one is written."""
    monkeypatch.setattr(atomic_files, "WRITE_CHUNK", 16)
    nan_code, nan_scale = fp8_sample(0), fp8_sample(1)
    nan_code["hidden_states"][1].codes.view(torch.uint8)[5, 7] = 0x7F
    nan_scale["hidden_states"][0].scales[4] = float("nan")
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, non_finite=names_bad_layers)
    for index, s in enumerate([nan_code, nan_scale, fp8_sample(2)]):
        writer.put(index, s)
    writer.close()
    assert sorted(writer.take_rejected()) == [(0, [1]), (1, [0])]
    assert sorted(Manifest(tmp_path).entries()) == [2]


def counting_writer(tmp_path, monkeypatch):
    """A one-worker writer in 64-byte chunks that logs each chunk the NaN/Inf scan reads and each whole-sample pass."""
    monkeypatch.setattr(atomic_files, "WRITE_CHUNK", 64)
    scanned, whole = [], []
    real_bytes_finite = finite.bytes_finite
    monkeypatch.setattr(
        finite, "bytes_finite", lambda data, dtype: scanned.append(len(data)) or real_bytes_finite(data, dtype)
    )
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, non_finite=lambda s: whole.append(s) or "bad")
    return writer, scanned, whole


def test_the_check_reads_every_float_byte_once_and_the_sample_no_more(tmp_path, monkeypatch):
    """Clean samples: the chunks scanned are every byte of every hidden state (no int), and no whole-sample pass runs."""
    writer, scanned, whole = counting_writer(tmp_path, monkeypatch)
    samples = [sample(i, tokens=11, hidden=6) for i in range(4)] + [fp8_sample(4, tokens=11, hidden=6)]
    for index, s in enumerate(samples):
        writer.put(index, s)
    writer.close()
    float_bytes = sum(h.nbytes for s in samples for h in s["hidden_states"])
    assert sum(scanned) == float_bytes and max(scanned) <= 64 and not whole
    assert sorted(Manifest(tmp_path).entries()) == [0, 1, 2, 3, 4]


def test_a_sample_proven_finite_on_the_device_is_not_read_for_the_test(tmp_path, monkeypatch):
    """put(finite=True): no chunk scanned and no whole-sample pass for it; the others still tested, load counts both."""
    writer, scanned, whole = counting_writer(tmp_path, monkeypatch)
    proven, tested = sample(0, tokens=11, hidden=6), sample(1, tokens=11, hidden=6)
    writer.put(0, proven, finite=True)
    writer.put(1, tested)
    writer.close()
    assert sum(scanned) == sum(h.nbytes for h in tested["hidden_states"]) and not whole
    assert sorted(Manifest(tmp_path).entries()) == [0, 1]
    assert (writer.load()["finite_proven"], writer.load()["finite_tested"]) == (1, 1)
    got = load_sample(tmp_path / "data_0.safetensors")["hidden_states"]
    assert all(torch.equal(a, b) for a, b in zip(got, proven["hidden_states"]))


def test_a_scan_the_whole_sample_check_contradicts_stops_the_run(tmp_path, monkeypatch):
    """The scan refusing a chunk while non_finite(sample) finds nothing is a bug: WriterThreadError, no file."""
    monkeypatch.setattr(finite, "bytes_finite", lambda data, dtype: False)
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, non_finite=lambda s: None)
    writer.put(0, sample(0))
    with pytest.raises(WriterThreadError, match=r"sample 0: the check during the write found NaN/Inf in its part 1"):
        writer.close()
    assert not list(tmp_path.glob("*data_0*"))


def test_a_float_type_without_a_bit_test_is_still_checked(tmp_path, monkeypatch):
    """A float dtype the bit test has no entry for gets torch.isfinite on each chunk, never no check."""
    monkeypatch.delitem(finite._TESTS, torch.bfloat16)
    monkeypatch.setattr(atomic_files, "WRITE_CHUNK", 32)
    bad = sample(0, tokens=9, hidden=5)
    bad["hidden_states"][1][8, 4] = float("nan")
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=1, non_finite=names_bad_layers)
    writer.put(0, bad)
    writer.put(1, sample(1, tokens=9, hidden=5))
    writer.close()
    assert writer.take_rejected() == [(0, [1])] and sorted(Manifest(tmp_path).entries()) == [1]


def test_load_says_whether_the_writers_set_the_pace(tmp_path):
    """A slow writer behind a queue of one: put() waits (counted), the worker busy most of the time; a fast one: no wait."""
    (tmp_path / "slow").mkdir()
    slow = SampleWriter(tmp_path / "slow", "safetensors", [1, 2], workers=1, bound=1,
                        reject=lambda s: time.sleep(0.2))  # fmt: skip
    for i in range(4):
        slow.put(i, sample(i))
    slow.close()
    load = slow.load()
    assert load["workers"] == 1 and load["waited"] >= 0.15 and 0.5 < load["busy"] <= 1.0
    (tmp_path / "fast").mkdir()
    fast = SampleWriter(tmp_path / "fast", "safetensors", [1, 2], workers=2)
    for i in range(4):
        fast.put(i, sample(i))
    fast.close()
    assert fast.load()["waited"] == 0.0 and len(Manifest(tmp_path / "fast").entries()) == 4


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_load_tells_cpu_from_waiting(tmp_path):
    """The writers' busy time splits into their own CPU time and waits: a sleeping check waits, a spinning one computes."""
    loads, writers = {}, {}
    for name, check in {"sleeps": lambda s: time.sleep(0.1), "spins": lambda s: spin(0.1)}.items():
        (tmp_path / name).mkdir()
        writer = SampleWriter(tmp_path / name, "safetensors", [1, 2], workers=1, reject=check)
        for i in range(3):
            writer.put(i, sample(i))
        writer.close()
        loads[name], writers[name] = writer.load(), writer
    # CPU seconds, not shares of wall time: a busy machine stretches the spinning thread's wall time, not its CPU
    assert writers["sleeps"].cpu < 0.1 < 0.3 <= writers["spins"].cpu
    for name, writer in writers.items():
        assert loads[name]["on_cpu"] == pytest.approx(writer.cpu / writer.busy)
        assert loads[name]["cpu_per_gib"] == pytest.approx(writer.cpu / (writer.bytes / 2**30))
    assert loads["sleeps"]["on_cpu"] < loads["spins"]["on_cpu"]
