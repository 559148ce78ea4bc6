"""Shared memory with the real command: a ring that vanished fails the run, concurrent runs both finish,
a SIGKILLed run's segments are reclaimed by the next run, clean-shm lists before it deletes."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.cli import CPU, conversations, invoke, write_jsonl
from helpers.shm import RECORDED, RUN, kill, make, private_shm, start
from speculators_v016.protocol import SHM_DIR
from speculators_v016.shared.shm_records import RECORDS_PREFIX, reclaim
from speculators_v016.shared.slot_ring import PREFIX
from speculators_v016.store.manifest import Manifest
from speculators_v016.testing.faults import VARIABLE as FAULT

#: vLLM's start method on GPUs (CUDA forces spawn): multiprocessing's semaphores keep their /dev/shm name.
SPAWN = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}

# They compare the whole /dev/shm before and after: another test's run beside them would show up there.
pytestmark = pytest.mark.alone


def arguments(model, data, out, *extra) -> list[str]:
    """The command's arguments of a run of these tests (for ``invoke`` or ``command``)."""
    args = [
        "--target-model-path",
        model,
        "--train-data-path",
        data,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        *extra,
    ]
    return list(map(str, args))


def command(model, data, out, *extra) -> list[str]:
    """A cold start of the real command: for runs that set what the warm interpreter's imports read, or
    that must be a process group of their own."""
    return [sys.executable, "-m", "speculators_v016.run.cli", *arguments(model, data, out, *extra)]


def run_segments() -> set[str]:
    """Regular files in /dev/shm of the kinds a run makes (ring, vLLM's queues, semaphores)."""
    return {
        e.name
        for e in os.scandir(SHM_DIR)
        if e.is_file(follow_symlinks=False) and e.name.startswith((PREFIX, "psm_", "sem."))
    }


def dead_runs_segments() -> set[str]:
    return {s.name for r in reclaim(SHM_DIR, delete=False).runs if not r.alive for s in r.segments if s.delete}


@pytest.mark.parametrize(
    "point, message",
    [
        ("ring-vanish:1", "is gone: something removed it"),
        ("ring-replace:1", "does not carry the engine's identity token"),
    ],
)
def test_a_ring_gone_before_the_worker_maps_it_fails_the_run_at_start(point, message, tmp_path, model_dir):
    """Ring name deleted (or replaced) before the worker maps it: exit 5 naming it, no sample written."""
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(20, seed=7))
    out = tmp_path / "out"
    before = run_segments()
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        "--executor",
        "mp",
        env={FAULT: point},
    )
    assert result.exit_code == 5, result.output
    assert message in result.output and f"capture ring {SHM_DIR}/{PREFIX}" in result.output
    assert not list(out.glob("data_*")) and Manifest(out).entries() == {}
    assert not (out / "data_config.json").exists()
    new = {n for n in run_segments() - before if n.startswith(PREFIX)}
    if point.startswith("ring-replace"):  # the impostor stays: the engine deletes only the file it created
        assert len(new) == 1
        os.unlink(os.path.join(SHM_DIR, new.pop()))
    assert not new


def test_two_runs_starting_together_both_finish(tmp_path, model_dir):
    """Two --executor mp runs of one user started at the same moment (same-node shards) both finish."""
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(12, seed=8))
    env = {**os.environ, **CPU, **SPAWN}
    procs = [
        subprocess.Popen(
            command(model_dir, data, tmp_path / f"out{i}", "--executor", "mp"),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=540)[0] for p in procs]
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    for i in range(2):
        assert len(Manifest(tmp_path / f"out{i}").entries()) == 12
    assert not dead_runs_segments()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigkilled_multiprocess_run_leaves_nothing_after_the_next_run(method, tmp_path, tiny_model):
    """SIGKILL of a whole --executor mp run (a preempted job) leaves recorded segments; the next run reclaims them."""
    model = tiny_model("llama")
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(300, seed=4))
    out = tmp_path / "out"
    env = {**os.environ, **CPU, "VLLM_WORKER_MULTIPROC_METHOD": method}
    cmd = command(model, data, out)
    before = run_segments()
    proc = subprocess.Popen(
        cmd + ["--executor", "mp", "--max-num-seqs", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while len(Manifest(out).entries()) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)  # let the kernel tear the killed processes down
    left = run_segments() - before
    assert left, "expected the killed run to leave vLLM's shared memory behind"
    assert left <= dead_runs_segments(), "the killed run left segments it had not recorded"
    if method == "spawn":
        assert any(n.startswith("sem.mp-") for n in left)  # multiprocessing's named semaphore, recorded too
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert not run_segments() & left
    assert not dead_runs_segments()
    assert len(Manifest(out).entries()) == 300


def test_a_resume_with_nothing_to_do_still_reclaims(tmp_path, model_dir):
    """A run that finds every sample written starts no engine, and still reclaims a dead run's segments."""
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(4, seed=9))
    out = tmp_path / "out"
    first = invoke(*arguments(model_dir, data, out))
    assert first.exit_code == 0, first.output
    tag = f"t{os.getpid()}"
    dead, _ = start(RUN.replace("run0001", tag), SHM_DIR)  # a killed run's record, in the real /dev/shm
    kill(dead)
    planted = {n.replace("run0001", tag) for n in RECORDED}
    assert planted <= set(os.listdir(SHM_DIR))
    again = invoke(*arguments(model_dir, data, out))
    assert again.exit_code == 0, again.output
    log = sorted((out / "logs").iterdir())[-1].read_text()
    assert "already written" in log and "reclaimed 3 shared-memory segments" in log
    assert not planted & set(os.listdir(SHM_DIR))


def test_clean_shm_lists_then_deletes_only_dead_runs_records():
    """clean-shm lists a dead run's recorded segments (deleting nothing), deletes them with --yes; others stay."""
    with private_shm() as shm:
        theirs = make(shm, "psm_not_ours")
        dead, _ = start(RUN, shm)
        kill(dead)
        alive, (alive_id,) = start(RUN.replace("run0001", "run0002"), shm)
        try:
            listed = invoke("clean-shm", "--shm-dir", shm)
            assert listed.exit_code == 0, listed.output
            for name in sorted(RECORDED):
                assert f"delete  {shm}/{name}" in listed.output
            assert f"run {alive_id} (pid {alive.pid}" in listed.output and "alive" in listed.output
            assert "would delete: 3 segments" in listed.output and "--yes" in listed.output
            assert RECORDED <= set(os.listdir(shm))
            done = invoke("clean-shm", "--shm-dir", shm, "--yes")
            assert done.exit_code == 0, done.output
            assert "deleted: 3 segments" in done.output
            left = set(os.listdir(shm)) - {f"{RECORDS_PREFIX}{os.getuid()}"}
            assert left == {theirs.name} | {n.replace("run0001", "run0002") for n in RECORDED}
        finally:
            kill(alive)
