"""tools/patches.py rebase: synthetic upstream releases for every outcome, and the real next release."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from patchtool.artifact import LOCAL_ARTIFACT_ENV, Pin, sha256_of  # noqa: E402
from patchtool.cli import check_series  # noqa: E402
from patchtool.worktree import export_series, git, materialise, read_series, write_series  # noqa: E402

LINES = [f"line {i}" for i in range(20)]
HEADER = "\n\nDescription: test\nOrigin: vendor\nForwarded: not-needed\nLast-Update: 2026-11-29"


def make_wheel(folder: Path, version: str, changes: dict | None = None, requires=("torch",)) -> Path:
    """A minimal upstream wheel: speculators/a.py and b.py of 20 lines, with ``changes`` applied."""
    files = {
        "speculators/__init__.py": "",
        "speculators/a.py": "\n".join(LINES) + "\n",
        "speculators/b.py": "\n".join(LINES) + "\n",
    }
    for path, edit in (changes or {}).items():
        files[path] = edit(files.get(path, ""))
    wheel = folder / f"speculators-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        meta = f"Metadata-Version: 2.1\nName: speculators\nVersion: {version}\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        zf.writestr(f"speculators-{version}.dist-info/METADATA", meta)
        zf.writestr(f"speculators-{version}.dist-info/licenses/LICENSE", "Apache License\n")
    return wheel


def replace_line(number: int, text: str):
    def edit(content: str) -> str:
        lines = content.splitlines()
        lines[number] = text
        return "\n".join(lines) + "\n"

    return edit


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """Upstream 1.0 pinned, and a series of two patches (a.py line 10, b.py line 5)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv(LOCAL_ARTIFACT_ENV, str(wheels))
    base = make_wheel(wheels, "1.0")
    patches = tmp_path / "patches"
    patches.mkdir()
    Pin("speculators", "1.0", base.name, sha256_of(base)).save(patches / "upstream.json")
    (patches / "series").write_text("")
    work = tmp_path / "author"
    materialise(work, patches)
    for path, number, subject in (("a.py", 10, "Patch a"), ("b.py", 5, "Patch b")):
        target = work / "speculators" / path
        target.write_text(replace_line(number, f"line {number} patched")(target.read_text()))
        git(work, "commit", "-qam", subject + HEADER)
    write_series(patches, export_series(work))
    assert check_series(patches) == []
    return wheels, patches, tmp_path / "rebase"


def rebase(patches: Path, work: Path, *args):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "patches.py"),
            "--patches",
            str(patches),
            "rebase",
            "--work",
            str(work),
            *args,
        ],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    report = json.loads(proc.stdout) if "--json" in args and proc.stdout.startswith("{") else None
    return proc, report


def snapshot(patches: Path) -> dict:
    return {p.name: p.read_bytes() for p in patches.iterdir()}


def test_onto_the_pinned_release_is_a_noop(setup):
    """Rebasing onto the pinned release itself: exit 0, all clean, nothing written."""
    wheels, patches, work = setup
    before = snapshot(patches)
    proc, report = rebase(patches, work, "--onto-artifact", str(wheels / "speculators-1.0-py3-none-any.whl"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert report["result"] == "clean" and [p["status"] for p in report["patches"]] == ["clean", "clean"]
    assert snapshot(patches) == before and not work.exists()


def test_clean_rebase_writes_the_new_pin(setup):
    """Unrelated upstream changes: patches apply clean, the pin moves, check passes on the new base."""
    wheels, patches, work = setup
    new = make_wheel(wheels, "1.1", {"speculators/c.py": lambda _: "new = 1\n"}, requires=("torch", "numpy"))
    proc, report = rebase(patches, work, "--onto-artifact", str(new), "--json")
    assert proc.returncode == 0, proc.stderr
    assert report["dependencies"] == {"added": ["numpy"], "removed": []}
    assert Pin.load(patches / "upstream.json") == Pin("speculators", "1.1", new.name, sha256_of(new))
    assert check_series(patches) == []


def test_three_way_merge_is_reported_for_review(setup):
    """Upstream edits next to a hunk: 3-way merge applies it, exit 1 asks for review."""
    wheels, patches, work = setup
    new = make_wheel(wheels, "1.2", {"speculators/a.py": replace_line(8, "line 8 upstream")})
    proc, report = rebase(patches, work, "--onto-artifact", str(new), "--json")
    assert proc.returncode == 1, proc.stderr
    assert [p["status"] for p in report["patches"]] == ["3way", "clean"]
    assert report["finished"] and "Patch-a.patch" in report["wrote"]
    assert "line 8 upstream" in (patches / "Patch-a.patch").read_text()
    assert check_series(patches) == []


def test_patch_already_upstream_is_dropped(setup):
    """Upstream made our change itself: the patch is reported and leaves the series."""
    wheels, patches, work = setup
    new = make_wheel(wheels, "1.3", {"speculators/a.py": replace_line(10, "line 10 patched")})
    proc, report = rebase(patches, work, "--onto-artifact", str(new), "--json")
    assert [p["status"] for p in report["patches"]] == ["already-upstream", "clean"], proc.stderr
    assert read_series(patches) == ["Patch-b.patch"] and not (patches / "Patch-a.patch").exists()
    assert check_series(patches) == []


def test_conflict_then_continue(setup):
    """A conflicting upstream edit stops with details; after resolving, --continue finishes."""
    wheels, patches, work = setup
    before = snapshot(patches)
    new = make_wheel(wheels, "2.0", {"speculators/a.py": replace_line(10, "line 10 upstream")})
    proc, report = rebase(patches, work, "--onto-artifact", str(new), "--json")
    assert proc.returncode == 1
    conflict, pending = report["patches"]
    assert pending["status"] == "pending" and pending["forecast"]["status"] == "clean"
    assert conflict["status"] == "conflict" and conflict["files"] == ["speculators/a.py"]
    assert conflict["hunks"] == {"speculators/a.py": 1} and conflict["work_tree"] == str(work)
    assert "line 10 patched" in conflict["current_patch"]
    assert snapshot(patches) == before  # nothing written before the end
    (work / "speculators" / "a.py").write_text(
        "\n".join(LINES[:10] + ["line 10 upstream and patched"] + LINES[11:]) + "\n"
    )
    git(work, "add", "speculators/a.py")
    proc, report = rebase(patches, work, "--continue", "--json")
    assert proc.returncode == 1, proc.stderr  # a resolved conflict still wants review
    assert [p["status"] for p in report["patches"]] == ["resolved", "clean"]
    assert "+line 10 upstream and patched" in (patches / "Patch-a.patch").read_text()
    assert Pin.load(patches / "upstream.json").version == "2.0"
    assert check_series(patches) == []


def test_conflict_then_abort_leaves_the_repository_untouched(setup):
    """--abort after a conflict removes the work tree and changes nothing in patches/."""
    wheels, patches, work = setup
    before = snapshot(patches)
    new = make_wheel(wheels, "2.1", {"speculators/a.py": replace_line(10, "line 10 upstream")})
    rebase(patches, work, "--onto-artifact", str(new))
    assert work.exists()
    proc, _ = rebase(patches, work, "--abort")
    assert proc.returncode == 0 and not work.exists()
    assert snapshot(patches) == before


def test_onto_a_source_checkout_reports_without_pinning(setup, tmp_path):
    """A folder (src/ layout) can be rebased onto; the pin is left alone."""
    wheels, patches, work = setup
    tree = tmp_path / "checkout"
    with zipfile.ZipFile(make_wheel(wheels, "3.0", {"speculators/b.py": replace_line(1, "line 1 upstream")})) as zf:
        zf.extractall(tree / "src")
    proc, report = rebase(patches, work, "--onto-path", str(tree), "--json")
    assert [p["status"] for p in report["patches"]] == ["clean", "clean"], proc.stderr
    assert Pin.load(patches / "upstream.json").version == "1.0"
    assert any("pin unchanged" in w for w in report["wrote"])


def test_usage_error_exits_2(setup):
    """Two targets at once is a usage error (exit 2)."""
    _, patches, work = setup
    proc, _ = rebase(patches, work, "--onto", "9.9", "--onto-path", "/nowhere")
    assert proc.returncode == 2


def test_real_next_release_from_the_index(tmp_path):
    """A dry-run rebase onto upstream 0.4.0 from the package index produces a full report."""
    work = tmp_path / "rebase"
    before = snapshot(ROOT / "patches")
    proc, report = rebase(ROOT / "patches", work, "--onto", "0.4.0", "--dry-run", "--json")
    if proc.returncode == 2 and "could not download upstream artifact" in proc.stderr:
        pytest.skip(f"package index unreachable: {proc.stderr.strip()[:200]}")
    assert proc.returncode in (0, 1), proc.stderr
    assert report["new"].startswith("speculators 0.4.0") and report["patches"]
    assert {m["upstream"] for m in report["wrapped_modules"]} >= {
        "speculators/data_generation/vllm_hidden_states_generator.py"
    }
    assert "added" in report["dependencies"]
    assert snapshot(ROOT / "patches") == before


def test_real_pinned_release_is_a_noop(tmp_path):
    """Rebasing the real series onto its own pinned release from the index: exit 0, all clean, no byte changed."""
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", patches)
    before = snapshot(patches)
    version = Pin.load(patches / "upstream.json").version
    proc, report = rebase(patches, tmp_path / "rebase", "--onto", version, "--json")
    if proc.returncode == 2 and "could not download upstream artifact" in proc.stderr:
        pytest.skip(f"package index unreachable: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    assert report["result"] == "clean" and {p["status"] for p in report["patches"]} == {"clean"}
    assert not any(m["changed"] for m in report["wrapped_modules"])
    assert report["dependencies"] == {"added": [], "removed": []}
    assert snapshot(patches) == before


@pytest.fixture
def series_of_four(tmp_path, monkeypatch):
    """Upstream 1.0 with a.py, b.py, c.py, d.py; four patches: a:10, b:5, b:15, c:3 (c.py is wrapped)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    monkeypatch.setenv(LOCAL_ARTIFACT_ENV, str(wheels))
    extra = {
        f"speculators/{n}.py": (lambda _, n=n: "\n".join(f"{n} {line}" for line in LINES) + "\n") for n in ("c", "d")
    }
    base = make_wheel(wheels, "1.0", extra)
    patches = tmp_path / "patches"
    patches.mkdir()
    Pin("speculators", "1.0", base.name, sha256_of(base)).save(patches / "upstream.json")
    (patches / "series").write_text("")
    (patches / "wrapped-modules.json").write_text(json.dumps({"ours/c_rewrite.py": ["speculators/c.py"]}))
    work = tmp_path / "author"
    materialise(work, patches)
    for path, number, subject in (
        ("a.py", 10, "Patch a"),
        ("b.py", 5, "Patch b"),
        ("b.py", 15, "Patch b again"),
        ("c.py", 3, "Patch c"),
        ("d.py", 3, "Patch d"),
    ):
        target = work / "speculators" / path
        target.write_text(replace_line(number, f"line {number} patched")(target.read_text()))
        git(work, "commit", "-qam", subject + HEADER)
    write_series(patches, export_series(work))
    return wheels, patches, tmp_path / "rebase", extra


def test_forecast_covers_every_patch_when_the_first_conflicts(series_of_four):
    """First patch conflicts: later ones are forecast clean, conflicting, target-deleted, target-renamed."""
    wheels, patches, work, extra = series_of_four
    before = snapshot(patches)
    d_text = extra["speculators/d.py"]("")
    new = make_wheel(
        wheels,
        "2.0",
        {
            **extra,
            "speculators/a.py": replace_line(10, "line 10 upstream"),
            "speculators/b.py": replace_line(15, "line 15 upstream"),
        },
    )
    new = rebuild_without(  # upstream 2.0 deleted c.py and renamed d.py
        new, {"speculators/c.py": None, "speculators/d.py": "speculators/d_new.py"}, d_text
    )
    proc, report = rebase(patches, work, "--onto-artifact", str(new), "--json")
    assert proc.returncode == 1, proc.stderr  # exit codes unchanged: a conflict is 1
    names = read_series(patches)
    assert [p["name"] for p in report["patches"]] == names  # every patch of the series is listed
    assert [p["status"] for p in report["patches"]] == ["conflict", "pending", "pending", "pending", "pending"]
    assert [p["forecast"]["status"] for p in report["patches"]] == [
        "conflict",
        "clean",
        "conflict",
        "target-deleted",
        "target-renamed",
    ]
    assert report["summary"] == "2 conflict, 1 target deleted, 1 target renamed, 1 clean"
    deleted = report["patches"][3]["forecast"]
    assert deleted["moved"] == [
        {
            "path": "speculators/c.py",
            "to": None,
            "meaning": "upstream removed the module ours/c_rewrite.py replaces: "
            "the patch (and any redirect to our module) must move or go",
        }
    ]
    assert deleted["hunks"] == {"speculators/c.py": "deleted upstream"}  # not "0 hunks"
    renamed = report["patches"][4]["forecast"]
    assert renamed["moved"][0]["to"] == "speculators/d_new.py"
    assert [m["upstream_state"] for m in report["wrapped_modules"]] == ["deleted"]
    text, _ = rebase(patches, tmp_path_of(work) / "again", "--onto-artifact", str(new), "--dry-run")
    assert "forecast for the whole series: 2 conflict, 1 target deleted, 1 target renamed, 1 clean" in text.stdout
    assert "pending (target-deleted)" in text.stdout and "(DELETED) -> review ours/c_rewrite.py" in text.stdout
    assert snapshot(patches) == before


def tmp_path_of(work: Path) -> Path:
    return work.parent


def rebuild_without(wheel: Path, moves: dict, renamed_text: str) -> Path:
    """The same wheel with files deleted (None) or renamed (new path)."""
    with zipfile.ZipFile(wheel) as zf:
        files = {n: zf.read(n) for n in zf.namelist()}
    for old, new in moves.items():
        files.pop(old)
        if new:
            files[new] = renamed_text.encode()
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel
