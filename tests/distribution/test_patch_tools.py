"""tools/patches.py: apply, refresh and check on real and broken series."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from patchtool.cli import check_series  # noqa: E402
from patchtool.worktree import git, has_unexported, read_series  # noqa: E402


def tool(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "patches.py"), *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.fixture
def series(tmp_path):
    """A scratch copy of patches/."""
    copy = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", copy)
    return copy


@pytest.fixture
def work(tmp_path, series):
    """A work tree made by `apply` from the scratch series."""
    tree = tmp_path / "work"
    proc = tool("--patches", str(series), "apply", "--work", str(tree))
    assert proc.returncode == 0, proc.stderr
    return tree


def test_apply_makes_pristine_upstream_plus_one_commit_per_patch(work, series):
    """The work tree's first commit is pristine upstream; one commit per patch follows."""
    log = git(work, "log", "--reverse", "--format=%s").splitlines()
    assert log[0].startswith("Upstream speculators 0.3.0")
    assert len(log) == 1 + len(read_series(series))
    assert git(work, "tag", "--points-at", f"HEAD~{len(read_series(series))}").split() == ["upstream"]


def test_refresh_of_an_unchanged_tree_changes_no_byte(work, series):
    """apply then refresh rewrites the series byte for byte."""
    before = {p.name: p.read_bytes() for p in series.iterdir()}
    proc = tool("--patches", str(series), "refresh", "--work", str(work))
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.read_bytes() for p in series.iterdir()} == before


def test_a_new_commit_becomes_a_patch_named_from_its_subject(work, series):
    """A commit in the work tree is exported as a new patch at the end of the series."""
    init = work / "speculators" / "__init__.py"
    init.write_text(init.read_text() + "\n# touched\n")
    git(
        work,
        "commit",
        "-qam",
        "Touch the package init\n\nDescription: test\nOrigin: vendor\nForwarded: not-needed\nLast-Update: 2026-11-29",
    )
    assert has_unexported(work)
    proc = tool("--patches", str(series), "refresh", "--work", str(work))
    assert proc.returncode == 0, proc.stderr
    assert read_series(series)[-1] == "Touch-the-package-init.patch"
    assert not has_unexported(work)
    assert check_series(series) == []


def test_apply_refuses_to_discard_unexported_work(work, series):
    """apply will not overwrite a tree holding commits that were not refreshed."""
    (work / "speculators" / "version.py").write_text("version = 'x'\n")
    proc = tool("--patches", str(series), "apply", "--work", str(work))
    assert proc.returncode == 1 and "not exported yet" in proc.stderr


def test_check_finds_a_missing_header(series):
    """A patch without a DEP-3 field fails check, naming patch and field."""
    name = read_series(series)[0]
    path = series / name
    path.write_text(path.read_text().replace("Forwarded: ", "Sent: ", 1))
    assert check_series(series) == [f"{name}: no DEP-3 'Forwarded:' field"]


def test_check_finds_unlisted_and_missing_patches(series):
    """A patch file not in series, and a series entry with no file, both fail check."""
    (series / "Stray.patch").write_text("x")
    (series / "series").write_text((series / "series").read_text() + "Gone.patch\n")
    problems = check_series(series)
    assert "Stray.patch: not listed in series" in problems
    assert "Gone.patch: listed in series but missing" in problems


def test_check_finds_a_patch_that_no_longer_applies(series):
    """A patch whose context does not match upstream fails check (no fuzz, no 3-way)."""
    text = series / read_series(series)[0]
    text.write_text(text.read_text().replace(" import json\n", " import jsonx\n", 1))
    problems = check_series(series)
    assert len(problems) == 1 and "does not apply" in problems[0]
