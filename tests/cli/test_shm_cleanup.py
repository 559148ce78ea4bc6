"""Shared memory: stale segments of dead runs reclaimed, live ones never; a ring that vanished fails the run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import CPU, conversations, invoke, write_jsonl
from speculators_v016.store.manifest import Manifest
from speculators_v016.engine.shm_sweep import stale_segments, sweep
from speculators_v016.engine.slot_ring import PREFIX, SHM_DIR
from speculators_v016.testing.faults import VARIABLE as FAULT


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


@pytest.mark.parametrize("point, message", [("ring-vanish:1", "is gone: something removed it"),
                                            ("ring-replace:1", "does not carry the engine's identity token")])
def test_a_ring_gone_before_the_worker_maps_it_fails_the_run_at_start(point, message, tmp_path, model_dir):
    """Ring name deleted (or replaced) before the worker maps it: exit 5 naming it, no sample written."""
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(20, seed=7))
    out = tmp_path / "out"
    before = set(os.listdir(SHM_DIR))
    result = invoke("--target-model-path", model_dir, "--train-data-path", data, "--output-dir", out,
                    "--seq-length", 256, "--token-freq-path", "", "--executor", "mp", env={FAULT: point})
    assert result.exit_code == 5, result.output
    assert message in result.output and f"capture ring {SHM_DIR}/{PREFIX}" in result.output
    assert not list(out.glob("data_*")) and Manifest(out).entries() == {}
    assert not (out / "data_config.json").exists()
    new = {n for n in set(os.listdir(SHM_DIR)) - before if n.startswith(PREFIX)}
    if point.startswith("ring-replace"):  # the impostor stays: the engine deletes only the file it created
        assert len(new) == 1
        os.unlink(os.path.join(SHM_DIR, new.pop()))
    assert not new


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
