"""The sample writer: workers, rejection, group commit order, errors (real files in a temp folder)."""

import errno
import os
import threading
import time

import blake3
import pytest
import torch

from speculators_v016.config import WRITER_NICE_INCREMENT
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

    def write_parts(fh, parts, digest):
        if "data_4" in fh.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fh, parts, digest)

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
