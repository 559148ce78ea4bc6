"""One --output-dir, one layout: an unsharded run or shard folders of one count, never both (a trainer reads the
folder recursively)."""

import os
from pathlib import Path

import pytest

from helpers.folders import make_folder  # a folder as a run writes it
from speculators_v016.shared.shm_records import records_path
from speculators_v016.store.outdir import LOCK, OutputDir, OutputDirError, ShardedRoot, shard_dir, unsharded_run_files
from speculators_v016.store.verify import verify


def test_a_sharded_run_into_an_unsharded_run_is_refused(tmp_path):
    """Shard folders beside a finished unsharded run: refused naming its files, nothing created."""
    out = tmp_path / "out"
    with OutputDir(out):
        (out / "data_config.json").write_text("{}")
        (out / "data_0.safetensors").write_bytes(b"")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(OutputDirError, match=r"holds an unsharded run \(data_0.safetensors, data_config.json\)"):
        ShardedRoot(out, 2).open()
    assert sorted(p.name for p in out.iterdir()) == before


def test_an_unsharded_run_into_shard_folders_is_refused(tmp_path):
    """An unsharded run into a folder of shard folders: refused naming them (not 'files this tool did not write')."""
    out = tmp_path / "out"
    with ShardedRoot(out, 2), OutputDir(shard_dir(out, 1, 2)):
        pass
    with pytest.raises(OutputDirError, match=r"holds the shard folders of a sharded run \(shard-00001-of-00002\)"):
        OutputDir(out).open()


def test_shards_of_another_count_are_refused(tmp_path):
    """A run split 4 ways into a folder of a run split 2 ways: refused naming both."""
    out = tmp_path / "out"
    with ShardedRoot(out, 2), OutputDir(shard_dir(out, 0, 2)):
        pass
    with pytest.raises(OutputDirError, match=r"another way \(shard-00000-of-00002\); this run is split 4 ways"):
        ShardedRoot(out, 4).open()


def test_shards_share_the_root_and_exclude_an_unsharded_run(tmp_path):
    """Shards of one run hold the root together; an unsharded run cannot start while they run, nor they during it."""
    out = tmp_path / "out"
    with ShardedRoot(out, 2), ShardedRoot(out, 2):
        with pytest.raises(OutputDirError, match="another speculators-data-gen sharded run is writing to"):
            OutputDir(out).open()
    with OutputDir(out):
        with pytest.raises(OutputDirError, match=r"another speculators-data-gen run \(pid \d+\) is writing to"):
            ShardedRoot(out, 2).open()
    assert sorted(p.name for p in out.iterdir()) == [LOCK]


def test_an_output_dir_under_a_file_is_refused_by_name(tmp_path):
    """--output-dir whose parent is a file: OutputDirError naming it, not a raw OSError."""
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputDirError, match=rf"cannot create or read {tmp_path}/file/out \(Not a directory\)"):
        OutputDir(tmp_path / "file" / "out").open()


def test_the_shared_memory_records_folder_is_never_a_foreign_file(tmp_path):
    """An --output-dir of /dev/shm holds the mp executor's records folder: resumes, shard roots, verify accept it."""
    out = make_folder(tmp_path / "shm")
    records = Path(records_path(str(out)))
    records.mkdir()
    (records / "run-1.json").write_text("{}")
    with OutputDir(out):  # a resume: not "files this tool did not write"
        pass
    report = verify(out)
    assert report.ok, report.problems
    assert unsharded_run_files(os.listdir(out)) == [
        "data_0.safetensors",
        "data_1.safetensors",
        "data_2.safetensors",
        "data_config.json",
        "manifest.jsonl",
    ]
    sharded = tmp_path / "shm-sharded"
    (sharded / records.name).mkdir(parents=True)
    with ShardedRoot(sharded, 2), OutputDir(shard_dir(sharded, 0, 2)):
        pass
    assert (tmp_path / "shm-sharded" / records.name).is_dir()
    (out / "speculators-v016-runs-x").mkdir()  # not a records folder's name: foreign
    with pytest.raises(OutputDirError, match=r"holds files this tool did not write \(speculators-v016-runs-x\)"):
        OutputDir(out).open()


def test_a_deleted_lock_file_lets_no_second_run_into_the_folder(tmp_path):
    """The lock file deleted while a run writes (or while shards hold the root): a second run is still refused, the
    folder itself being locked, and names the deleted lock; the first run's files are untouched."""
    out = tmp_path / "out"
    with OutputDir(out):
        (out / "data_0.safetensors").write_bytes(b"first run")
        (out / LOCK).unlink()
        with pytest.raises(
            OutputDirError, match=r"another speculators-data-gen run \(pid \? \(its lock file was deleted"
        ):
            OutputDir(out).open()
        assert (out / "data_0.safetensors").read_bytes() == b"first run" and not (out / LOCK).exists()
    sharded = tmp_path / "sharded"
    with ShardedRoot(sharded, 2):
        (sharded / LOCK).unlink()
        with pytest.raises(OutputDirError, match="is writing to"):
            OutputDir(sharded).open()
    with OutputDir(out), OutputDir(sharded):  # the locks go with the runs
        pass


def test_only_our_own_temporary_files_are_removed_as_leftovers(tmp_path):
    """An interrupted write's temporary files (.tmp-NAME.PID, NAME ours) are removed when a run opens the folder; a
    user's .tmp-notes.txt is not ours: the folder is refused and the file kept (hostile review, 2026-12-07)."""
    out = tmp_path / "out"
    out.mkdir()
    ours = [".tmp-data_3.safetensors.4242", ".tmp-data_config.json.17", ".tmp-manifest.jsonl.9"]
    for name in ours:
        (out / name).write_text("torn")
    with OutputDir(out) as opened:
        assert sorted(opened.removed_leftovers) == sorted(ours)
    assert not list(p for p in out.iterdir() if p.name.startswith(".tmp-"))
    for name in (".tmp-notes.txt", ".tmp-data_3.safetensors", ".tmp-my.safetensors.12"):
        (out / name).write_text("the user's")
        with pytest.raises(OutputDirError, match="holds files this tool did not write"):
            OutputDir(out).open()
        assert (out / name).read_text() == "the user's"
        (out / name).unlink()
