"""Shared memory: stale segments of dead runs reclaimed, live ones never; a small /dev/shm refused clearly."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import CPU, conversations, write_jsonl
from speculators_v016.engine import slot_ring
from speculators_v016.store.manifest import Manifest
from speculators_v016.engine.shm_sweep import stale_segments, sweep
from speculators_v016.engine.slot_ring import PREFIX, RingSpaceError, SlotRing


def make(directory, name, size=4096):
    path = directory / name
    path.write_bytes(b"\0" * size)
    return path


HOLD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "map":
    m = mmap.mmap(fd, 4096)
    os.close(fd)
print("ready", flush=True)
time.sleep(60)
"""


def hold(path, how):
    """A live process that keeps ``path`` open (``fd``) or only mapped (``map``)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_sweep_removes_only_unused_segments_of_ours(tmp_path):
    """Unused ring/psm_/sem.mp- files go; files open or mapped by a live process, or not ours, stay."""
    stale = [make(tmp_path, f"{PREFIX}1-dead"), make(tmp_path, "psm_0badc0de"), make(tmp_path, "sem.mp-x1y2")]
    opened, mapped = make(tmp_path, "psm_open"), make(tmp_path, "psm_mapped")
    unrelated = make(tmp_path, "someone-elses-cache")
    holders = [hold(opened, "fd"), hold(mapped, "map")]
    try:
        result = sweep(str(tmp_path))
        assert sorted(result.removed) == sorted(p.name for p in stale)
        assert result.bytes >= 3 * 4096
        assert opened.exists() and mapped.exists() and unrelated.exists()
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
    assert sorted(p.name for p in stale_segments(str(tmp_path))) == ["psm_mapped", "psm_open"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_sweep_never_touches_another_users_segment(tmp_path):
    """A stale-looking segment owned by another user is left alone."""
    theirs = make(tmp_path, "psm_theirs")
    os.chown(theirs, 65534, 65534)
    assert sweep(str(tmp_path)).removed == [] and theirs.exists()


def test_small_dev_shm_is_refused_with_the_bytes_needed(monkeypatch):
    """A /dev/shm that cannot hold the ring fails at once, naming the bytes and how to need fewer."""
    monkeypatch.setattr(slot_ring, "_shm_free_bytes", lambda: 64 * 2**20)
    with pytest.raises(RingSpaceError) as info:
        SlotRing.create(slots=3, num_ids=4, max_rows=8192, hidden=7168, dtype=__import__("torch").bfloat16,
                        shared=True)
    message = str(info.value)
    assert "1,409,286,144 bytes" in message and "--max-num-batched-tokens (now 8192)" in message
    assert "--shm-size" in message and "64 MiB free" in message
    assert not [p for p in os.listdir(slot_ring.SHM_DIR) if p.startswith(f"{PREFIX}{os.getpid()}-")]


def test_ring_file_is_gone_once_mapped_and_slots_are_bounded():
    """The owner unlinks the /dev/shm name after mapping; slots come back only when released."""
    ring = SlotRing.create(slots=2, num_ids=2, max_rows=8, hidden=4, dtype=__import__("torch").float32,
                           shared=True)
    worker = SlotRing.attach(ring.spec)
    worker.slot(1)[0, :3] = 7.0
    assert (ring.slot(1)[0, :3] == 7.0).all()  # one shared mapping
    ring.unlink()
    assert not os.path.exists(ring.spec.path)
    assert (ring.acquire(), ring.acquire()) == (0, 1)
    with pytest.raises(RuntimeError, match="all 2 capture slots are in use"):
        ring.acquire()
    ring.release(0)
    with pytest.raises(RuntimeError, match="released twice"):
        ring.release(0)
    assert ring.acquire() == 0
    ring.close()


def test_sigkilled_multiprocess_run_leaves_nothing_after_the_next_run(tmp_path, tiny_model):
    """SIGKILL of a whole --executor mp run (a preempted job) leaves segments; the next run reclaims them."""
    model = tiny_model("llama")
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(300, seed=4))
    out = tmp_path / "out"
    args = ["--target-model-path", model, "--train-data-path", data, "--output-dir", out, "--seq-length", 256,
            "--token-freq-path", ""]
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", *map(str, args)]
    before = {p.name for p in stale_segments()}
    proc = subprocess.Popen(cmd + ["--executor", "mp", "--max-num-seqs", "2"], env={**os.environ, **CPU},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while len(Manifest(out).entries()) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)  # let the kernel tear the killed processes down
    left = {p.name for p in stale_segments()} - before
    assert left, "expected the killed run to leave vLLM's shared memory behind"
    resumed = subprocess.run(cmd, env={**os.environ, **CPU}, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not {p.name for p in stale_segments()} & left
    assert stale_segments() == []
    assert len(Manifest(out).entries()) == 300
