"""Links in the output folder against the real command (real symlinks in temporary folders): a folder holding one
is refused naming it before anything is written; links planted under the temporary names of the files a run is
writing are never written through. Every target keeps its bytes and mtime; what was written is kept."""

import os

import pytest

from helpers.cli import conversations, generate, invoke, load_all, write_jsonl
from speculators_v016.store.manifest import Manifest
from speculators_v016.testing.faults import TARGET
from speculators_v016.testing.faults import VARIABLE as FAULT

COUNT = 8
PAST = 1_000_000_000_000_000_000  # an mtime in 2001: any write moves it


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("link-data") / "chats.jsonl", conversations(COUNT, seed=3))


def plant(folder, names, text="precious\n"):
    """Files outside the output folder, with an mtime in the past: (bytes, mtime) of each, to compare after."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text(text)
        os.utime(folder / name, ns=(PAST, PAST))
    return snapshot(folder)


def snapshot(folder):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name", ["manifest.jsonl", "logs"])
def test_a_folder_holding_a_link_is_refused_and_nothing_goes_through_it(tmp_path, model_dir, data_file, name):
    """OUT/manifest.jsonl linked to an empty file elsewhere, OUT/logs to another folder: exit 4 naming the link and
    its target; the target keeps its bytes and mtime (no line appended, no log made there), OUT is left as it was."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    before = plant(elsewhere, ["notes.jsonl"], text="")
    out.mkdir()
    target = elsewhere / "notes.jsonl" if name == "manifest.jsonl" else elsewhere
    (out / name).symlink_to(target)
    result = generate(model_dir, data_file, out)
    assert result.exit_code == 4, result.output
    assert f"holds symbolic links ({name} -> {target})" in result.output, result.output
    assert snapshot(elsewhere) == before and sorted(os.listdir(out)) == [name]


def test_links_planted_under_temporary_names_during_a_run_are_never_written_through(tmp_path, model_dir, data_file):
    """From the third sample file on, each temporary name the writer is about to create is found taken by a link to
    a file elsewhere: the run stops (exit 4) naming it; none of the files elsewhere changes; the two samples written
    before are listed and kept. With the links removed, the resume completes the folder and verify passes."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    before = plant(elsewhere, [f"data_{i}.safetensors" for i in range(COUNT)])
    env = {FAULT: "plant-tmp-link:3", TARGET: str(elsewhere)}
    result = generate(model_dir, data_file, out, "--write-workers", 1, env=env)
    assert result.exit_code == 4, result.output
    assert "a symbolic link someone else made under a name this run was creating" in result.output, result.output
    assert snapshot(elsewhere) == before
    listed = Manifest(out).entries()
    assert len(listed) == 2 and sorted(p.name for p in out.glob("data_*.safetensors")) == sorted(
        e.file for e in listed.values()
    )
    kept = {i: (out / e.file).read_bytes() for i, e in listed.items()}
    links = [p for p in out.iterdir() if p.is_symlink()]
    assert len(links) == 1 and links[0].name.startswith(".tmp-data_")
    refused = generate(model_dir, data_file, out)  # the link is still there: the folder is refused
    assert refused.exit_code == 4 and f"holds symbolic links ({links[0].name} -> " in refused.output, refused.output
    links[0].unlink()
    resumed = generate(model_dir, data_file, out)
    assert resumed.exit_code == 0, resumed.output
    assert sorted(load_all(out)) == list(range(COUNT)) and snapshot(elsewhere) == before
    assert {i: (out / e.file).read_bytes() for i, e in listed.items()} == kept
    assert invoke("verify", out).exit_code == 0
