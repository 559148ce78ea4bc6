"""Links in an output folder (speculators_v016.store.no_links and its users), with real symlinks and hard links in
temporary folders: a folder holding links is refused naming them; a link met while writing is never written
through; every target keeps its bytes and mtime, and what was already written is kept."""

import os
import threading
from pathlib import Path

import pytest
import torch

from helpers.folders import make_folder  # a folder as a run writes it
from speculators_v016.exit_codes import ExitCode
from speculators_v016.run.console import Console, open_log, run_log_path
from speculators_v016.run.run_report import exit_code
from speculators_v016.serve.folder import ServeDir, ServeDirError
from speculators_v016.store import regenerated
from speculators_v016.store.atomic_files import TMP_PREFIX, write_atomic, write_durable
from speculators_v016.store.manifest import Entry, Manifest, ManifestError
from speculators_v016.store.no_links import LinkedEntryError
from speculators_v016.store.outdir import LOCK, OutputDir, OutputDirError, ShardedRoot, shard_dir
from speculators_v016.store.verify import verify
from speculators_v016.store.writer import SampleWriter


def victim(folder: Path, name: str = "victim", text: str = "precious\n") -> Path:
    """A file outside the output folder, its mtime set in the past (a write would move it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    os.utime(path, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    return path


def untouched(path: Path, text: str = "precious\n") -> bool:
    info = os.stat(path)
    return path.read_text() == text and info.st_mtime_ns == 1_000_000_000_000_000_000


def sample(index: int, tokens: int = 6) -> dict:
    return {
        "input_ids": torch.arange(tokens) + index,
        "loss_mask": torch.ones(tokens, dtype=torch.long),
        "hidden_states": [torch.full((tokens, 4), float(index + j)) for j in range(2)],
    }


@pytest.mark.parametrize("name", ["manifest.jsonl", "logs", "data_config.json", "data_0.safetensors", LOCK])
def test_a_folder_holding_a_link_is_refused_naming_it_and_left_as_it_was(tmp_path, name):
    """manifest.jsonl, logs, data_config.json, a sample or the lock as a link: refused (exit 4) naming the link and
    its target; nothing is made in the folder, the target untouched."""
    out, target = tmp_path / "out", victim(tmp_path / "elsewhere")
    out.mkdir()
    (out / name).symlink_to(target if name != "logs" else target.parent)
    with pytest.raises(
        OutputDirError, match=rf"holds symbolic links \({name} -> {target if name != 'logs' else target.parent}\)"
    ) as refused:
        OutputDir(out).open()
    assert exit_code(refused.value) == ExitCode.OUTPUT_REFUSED
    assert sorted(os.listdir(out)) == [name] and untouched(target)
    assert os.listdir(target.parent) == ["victim"]


def test_a_sharded_root_or_a_shard_folder_that_is_a_link_is_refused(tmp_path):
    """A shard folder planted as a link to another folder: the root refuses it, and so does the shard's own
    folder (a folder of ours inside --output-dir); the other folder stays empty."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    shard = shard_dir(out, 1, 2)
    shard.symlink_to(elsewhere)
    with pytest.raises(OutputDirError, match=r"holds symbolic links \(shard-00001-of-00002 -> "):
        ShardedRoot(out, 2).open()
    with pytest.raises(OutputDirError, match=r"shard-00001-of-00002 is a symbolic link"):
        OutputDir(shard, inside=True).open()
    assert os.listdir(elsewhere) == []


def test_the_folder_the_user_names_is_followed_when_it_is_a_link(tmp_path):
    """--output-dir given as a link to a folder is taken as named (a path argument): the run writes there."""
    real, given = tmp_path / "real", tmp_path / "given"
    real.mkdir()
    given.symlink_to(real)
    with OutputDir(given):
        write_atomic(given, "data_config.json", b"{}")
    assert sorted(os.listdir(real)) == [LOCK, "data_config.json"]


def test_a_lock_that_is_a_hard_link_to_another_file_is_refused_untouched(tmp_path):
    """The lock file hard-linked to a file elsewhere: its bytes would be replaced by our pid; refused instead."""
    out, target = tmp_path / "out", victim(tmp_path / "elsewhere", text="12345")
    out.mkdir()
    os.link(target, out / LOCK)
    with pytest.raises(OutputDirError, match=r"2 hard links"):
        OutputDir(out).open()
    assert untouched(target, "12345")


def test_a_temporary_name_taken_by_a_link_is_never_written_through(tmp_path):
    """A link (or another file) planted under the temporary name of a file being written: LinkedEntryError (exit 4)
    naming it; the target keeps its bytes and mtime, the planted entry stays, no final file appears."""
    out, target = tmp_path / "out", victim(tmp_path / "elsewhere")
    out.mkdir()
    tmp = out / f"{TMP_PREFIX}data_0.safetensors.{os.getpid()}"
    tmp.symlink_to(target)
    with pytest.raises(LinkedEntryError, match=rf"{tmp}: a symbolic link someone else made") as refused:
        write_durable(out, "data_0.safetensors", [b"sample bytes"])
    assert exit_code(refused.value) == ExitCode.OUTPUT_REFUSED
    assert untouched(target) and tmp.is_symlink() and sorted(os.listdir(out)) == [tmp.name]
    tmp.unlink()
    tmp.write_text("someone's file")
    with pytest.raises(LinkedEntryError, match=r"a file someone else made"):
        write_atomic(out, "data_0.safetensors", [b"sample bytes"])
    assert tmp.read_text() == "someone's file" and not (out / "data_0.safetensors").exists()


def test_a_writer_meeting_a_planted_link_stops_and_keeps_what_it_wrote(tmp_path):
    """The writer's first samples are written and listed; a link planted under the next one's temporary name stops
    it (LinkedEntryError, not a write error), the target untouched, the samples already listed kept."""
    out, target = tmp_path / "out", victim(tmp_path / "elsewhere")
    out.mkdir()
    writer = SampleWriter(out, "safetensors", [1, 2], workers=1, commit_interval=0.01)
    for i in range(2):
        writer.put(i, sample(i))
    while writer.written < 2:
        threading.Event().wait(0.01)
    (out / f"{TMP_PREFIX}data_2.safetensors.{os.getpid()}").symlink_to(target)
    writer.put(2, sample(2))
    with pytest.raises(LinkedEntryError, match=r"data_2.safetensors"):
        writer.close()
    assert untouched(target) and sorted(Manifest(out).entries()) == [0, 1]
    assert sorted(p.name for p in out.glob("data_*")) == ["data_0.safetensors", "data_1.safetensors"]


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_the_manifest_is_never_appended_to_through_a_link(tmp_path, kind):
    """manifest.jsonl replaced by a link (or a hard link) to a file elsewhere while a run appends: refused naming it;
    read, a symlink is a ManifestError; the target untouched."""
    out, target = tmp_path / "out", victim(tmp_path / "elsewhere", text="")
    out.mkdir()
    manifest = Manifest(out)
    (os.symlink if kind == "symlink" else os.link)(target, manifest.path)
    with pytest.raises(LinkedEntryError, match=r"manifest.jsonl: a (symbolic link|file of 2 hard links)"):
        manifest.append(Entry(0, "data_0.safetensors", 10, "ab" * 32, 5, "blake3"))
    assert untouched(target, "")
    if kind == "symlink":
        with pytest.raises(ManifestError, match=r"manifest.jsonl: cannot be read .*a symbolic link"):
            manifest.entries()


def test_the_journal_is_never_appended_to_or_read_through_a_link(tmp_path):
    """regenerated.journal.jsonl as a link: the run's journal refuses it, reading it is a JournalError (exit 4),
    verify names it; the target untouched."""
    out, target = tmp_path / "out", victim(tmp_path / "elsewhere", text="")
    out.mkdir()
    (out / regenerated.JOURNAL).symlink_to(target)
    with pytest.raises(LinkedEntryError, match=r"regenerated.journal.jsonl: a symbolic link"):
        regenerated.Journal(out)
    with pytest.raises(regenerated.JournalError, match=r"a symbolic link") as refused:
        regenerated.read_journal(out)
    assert exit_code(refused.value) == ExitCode.OUTPUT_REFUSED
    problems = []
    assert regenerated.read_journal(out, problems) == {} and "a symbolic link" in problems[0]
    assert untouched(target, "")


def test_a_logs_link_gets_no_log(tmp_path, monkeypatch):
    """OUT/logs as a link to another folder: the log is not made there. run_log_path sends it to the private folder
    (the run refuses OUT); a log asked for in it anyway is refused and the console falls back, saying why."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "no-such"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "logs").symlink_to(elsewhere)
    assert run_log_path(out, "run").parent != out / "logs"
    with pytest.raises(LinkedEntryError, match=r"logs: a symbolic link"):
        open_log(out / "logs" / "run-20260101-000000.log")
    console = Console(out / "logs" / "run-20260101-000000.log")
    try:
        console.__enter__()
        assert console.log_file.parent != out / "logs" and "logs: " in console.fallback
    finally:
        console.close()
    assert os.listdir(elsewhere) == []


def test_a_serve_folder_holding_a_link_is_refused_and_a_planted_temporary_name_not_written(tmp_path):
    """--serve-dir holding a link: refused naming it. A link planted under a publication's temporary name: that
    publication fails naming it (LinkedEntryError), the target untouched, the service's folder usable."""
    folder, target = tmp_path / "states", victim(tmp_path / "elsewhere")
    folder.mkdir()
    (folder / "published.jsonl").symlink_to(target)
    with pytest.raises(ServeDirError, match=r"holds symbolic links \(published.jsonl -> "):
        ServeDir(folder, max_bytes=1 << 20, lease_seconds=60).open()
    (folder / "published.jsonl").unlink()
    serve = ServeDir(folder, max_bytes=1 << 20, lease_seconds=60).open()
    try:
        tmp = folder / f"{TMP_PREFIX}online_0.safetensors.{os.getpid()}"
        tmp.symlink_to(target)
        serve.reserve(4, threading.Event())
        with pytest.raises(LinkedEntryError, match=r"online_0.safetensors"):
            serve.publish([b"abcd"], 4, None)
        assert untouched(target) and serve.outstanding() == 0
        tmp.unlink()
        serve.reserve(4, threading.Event())
        assert (folder / serve.publish([b"abcd"], 4, None)["file"]).read_bytes() == b"abcd"
    finally:
        serve.close()


def test_verify_names_links_and_never_follows_them(tmp_path):
    """A written folder with data_config.json and a stray entry replaced by links: each named, never followed."""
    out = make_folder(tmp_path / "out")
    target = victim(tmp_path / "elsewhere")
    (out / "logs").symlink_to(target.parent)
    report = verify(out)
    assert any(p == f"{out / 'logs'}: a symbolic link (-> {target.parent}), not a file this tool wrote (not followed)"
               for p in report.problems), report.problems  # fmt: skip
    config = (out / "data_config.json").read_bytes()
    (out / "data_config.json").unlink()
    (tmp_path / "config-copy.json").write_bytes(config)
    (out / "data_config.json").symlink_to(tmp_path / "config-copy.json")
    assert any("data_config.json: cannot be read" in p and "a symbolic link" in p for p in verify(out).problems)
