"""Shared-memory records: dead runs' recorded segments reclaimed exactly; nothing else, nothing alive, ever."""

import json
import mmap
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.shm import HOLD, RECORDED, REPO, RUN, kill, make, private_shm, start
from speculators_v016.shared import shm_records
from speculators_v016.shared.shm_records import RunRecord, reclaim, records_path


@pytest.fixture
def shm():
    """A private tmpfs folder standing in for /dev/shm."""
    with private_shm() as where:
        yield where


def names(shm):
    return {p for p in os.listdir(shm) if not p.startswith(shm_records.RECORDS_PREFIX)}


def test_a_dead_runs_recorded_segments_go_and_nothing_else(shm):
    """Killed run: its mapped, open and renamed (glibc semaphore) segments go; another program's psm_ stays."""
    theirs = make(shm, "psm_someone_elses_data")  # left for a later consumer, held by nobody
    run, (run_id,) = start(RUN, shm)
    try:
        alive = reclaim(shm)
        assert [(r.run, r.alive) for r in alive.runs] == [(run_id, True)]
        assert alive.deleted == [] and RECORDED <= names(shm)
    finally:
        kill(run)
    result = reclaim(shm)
    assert sorted(s.name for s in result.deleted) == sorted(RECORDED)
    assert result.bytes >= 3 * 8192
    assert names(shm) == {theirs.name}
    assert os.listdir(records_path(shm)) == []  # the dead run's record went with its segments
    assert reclaim(shm).runs == []


def test_records_are_updated_by_watching_and_the_ring_by_add(shm):
    """A record lists what the run's processes hold after it started (not before), and what it adds."""
    before = make(shm, "psm_held_before")
    with open(before, "r+b") as fh:
        early = mmap.mmap(fh.fileno(), 4096)
        record = RunRecord.open(shm)
        try:
            ring = make(shm, "ring-added")
            record.add(ring.name, os.stat(ring))
            fd = os.open(make(shm, "psm_after"), os.O_RDWR)
            with record.watching(interval=0.05):
                pass
            body = json.loads(Path(records_path(shm), f"{record.run}.json").read_text())
            assert {s["name"] for s in body["segments"]} == {"ring-added", "psm_after"}
            assert stat.S_IMODE(os.stat(records_path(shm)).st_mode) == 0o700
            os.close(fd)
        finally:
            record.close()
        early.close()
    # a clean close with recorded files still there keeps the record (and frees the lock): the next run reclaims
    assert sorted(s.name for s in reclaim(shm).deleted) == ["psm_after", "ring-added"]
    assert names(shm) == {"psm_held_before"}


LATER = """
import mmap, os, sys, time
print("ready", flush=True)
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
print("mapped", flush=True)
time.sleep(600)
"""


def test_children_older_than_the_record_are_not_the_runs(shm):
    """A child that existed before the engine started is not the engine's: what it maps later is not recorded."""
    older = subprocess.Popen(
        [sys.executable, "-c", LATER, os.path.join(shm, "psm_older_child")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert older.stdout.readline().strip() == "ready"
        record = RunRecord.open(shm)
        newer = subprocess.Popen(
            [sys.executable, "-c", LATER, os.path.join(shm, "psm_engine_worker")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert newer.stdout.readline().strip() == "ready"
            for child in (older, newer):
                child.stdin.write("go\n")
                child.stdin.flush()
                assert child.stdout.readline().strip() == "mapped"
            record.refresh()
            assert [s.name for s in record.segments] == ["psm_engine_worker"]
        finally:
            kill(newer)
            record.close()
    finally:
        kill(older)
    assert [s.name for s in reclaim(shm).deleted] == ["psm_engine_worker"]
    assert names(shm) == {"psm_older_child"}


def test_a_clean_close_with_nothing_left_removes_the_record(shm):
    """A run whose recorded files are gone at its end leaves no record behind."""
    record = RunRecord.open(shm)
    ring = make(shm, "ring-x")
    record.add(ring.name, os.stat(ring))
    ring.unlink()
    record.close()
    assert os.listdir(records_path(shm)) == []


def test_a_changed_name_is_never_deleted(shm):
    """A recorded name now a symlink, another file, or held by a live process is kept; the symlink's target too."""
    victim = make(shm, "victims-file")  # what a planted link points at
    run, (run_id,) = start(RUN, shm)
    kill(run)
    os.unlink(Path(shm) / "psm_run0001")
    os.symlink(victim, Path(shm) / "psm_run0001")  # planted link under a recorded name
    os.unlink(Path(shm) / "ring-run0001")
    make(shm, "ring-run0001")  # another file took the name
    holder, _ = start(HOLD, Path(shm) / "sem.mp-run0001")  # a straggler still maps it
    try:
        result = reclaim(shm)
        reasons = {s.name: s.reason for r in result.runs for s in r.segments}
        assert result.deleted == []
        assert "not a regular file" in reasons["psm_run0001"]
        assert "another file has this name" in reasons["ring-run0001"]
        assert f"still mapped or open by pid {holder.pid}" in reasons["sem.mp-run0001"]
        assert victim.exists() and os.path.islink(Path(shm) / "psm_run0001")
        assert (Path(shm) / "ring-run0001").exists() and (Path(shm) / "sem.mp-run0001").exists()
    finally:
        kill(holder)
    # the straggler is gone: the segment it held is reclaimed now (the record kept it for later); the rest stays
    assert [s.name for s in reclaim(shm).deleted] == ["sem.mp-run0001"]
    assert names(shm) == {"victims-file", "psm_run0001", "ring-run0001"}
    assert reclaim(shm).runs == []


def test_planted_links_in_the_folder_are_ignored(shm):
    """A symlink planted in /dev/shm is neither followed nor deleted, by a run or by reclaiming."""
    victim = make(shm, "victims-file")
    os.symlink(victim, Path(shm) / "psm_planted")
    run, _ = start(RUN, shm)
    kill(run)
    reclaim(shm)
    assert os.path.islink(Path(shm) / "psm_planted") and victim.read_bytes() == b"\0" * 4096


@pytest.mark.parametrize("plant", ["symlink", "open-mode"])
def test_a_records_folder_that_is_not_private_is_not_used(shm, plant, tmp_path):
    """A planted records folder (a link elsewhere, or open to others) is refused: nothing recorded or deleted."""
    path = records_path(shm)
    if plant == "symlink":
        os.symlink(tmp_path, path)
    else:
        os.mkdir(path)
        os.chmod(path, 0o777)
    (tmp_path / "x.lock").write_text("")
    assert RunRecord.open(shm) is None
    result = reclaim(shm)
    assert result.runs == [] and "not" in result.problem and path in result.problem
    assert os.listdir(tmp_path) == ["x.lock"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user")
def test_another_users_file_under_a_recorded_name_is_kept(shm):
    """A recorded name that now belongs to another user is left alone."""
    run, _ = start(RUN, shm)
    kill(run)
    os.chown(Path(shm) / "psm_run0001", 65534, 65534)
    reasons = {s.name: s.reason for r in reclaim(shm).runs for s in r.segments}
    assert "owned by uid 65534" in reasons["psm_run0001"] and (Path(shm) / "psm_run0001").exists()


def _unshare_prefix():
    for prefix in (["unshare", "-p", "-f", "--mount-proc"], ["unshare", "-U", "-r", "-p", "-f", "--mount-proc"]):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


RECLAIM = """
import json, os, sys
from speculators_v016.shared.shm_records import reclaim
result = reclaim(sys.argv[1])
print(json.dumps({"pids": len([p for p in os.listdir("/proc") if p.isdigit()]),
                  "deleted": [s.name for s in result.deleted], "alive": [r.alive for r in result.runs]}))
"""


def test_segments_held_in_another_pid_namespace_are_kept(shm):
    """Reclaiming from a PID namespace that sees no holder keeps a live run's record and a held psm_ segment."""
    prefix = _unshare_prefix()
    if prefix is None:
        pytest.skip("unshare -p -f --mount-proc is not permitted here (no new PID namespace)")
    theirs = make(shm, "psm_another_container")
    holder, _ = start(HOLD, theirs)  # another container's live queue, not ours
    run, _ = start(RUN, shm)  # a live run of ours in "another container"

    def reclaim_there():
        out = subprocess.run(
            [*prefix, sys.executable, "-c", RECLAIM, shm],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    try:
        seen = reclaim_there()
        assert seen["pids"] < 5, "the reclaimer was meant to see no process of ours"
        assert seen["deleted"] == [] and seen["alive"] == [True]
        assert RECORDED | {theirs.name} <= names(shm)
    finally:
        kill(run)
    try:
        seen = reclaim_there()  # the run is dead (its lock is free): its own segments go, the other queue stays
        assert sorted(seen["deleted"]) == sorted(RECORDED)
        assert names(shm) == {theirs.name}
    finally:
        kill(holder)
