"""Replay our series onto another upstream release with git's 3-way machinery, and report.

The work tree (``build/rebase``) holds: the old pinned upstream (tag
``old-upstream``) with the series on top (tag ``old-series``), and the new
upstream as a separate root commit (tag ``new-upstream``) onto which each patch
is replayed with ``git am --3way``. Each patch ends ``clean``, ``3way``
(applied with a 3-way merge: review it), ``already-upstream`` (nothing left
after the replay) or ``conflict`` (the am session waits in the work tree).
``--continue`` carries on after the conflict is resolved; when every patch is
replayed the refreshed series and the new pin are written to ``patches/``.
``--abort`` removes the work tree; ``patches/`` is only ever written at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .artifact import ArtifactError, Pin, download, fetch, sha256_of, unpack_wheel
from .forecast import conflict_hunks, forecast, summary, upstream_moves
from .worktree import PatchResult, SeriesError, am, export_series, git, read_series, write_series

STATE = "speculators-rebase.json"


@dataclass
class Source:
    """Where an upstream tree comes from: an index artifact, a local wheel, or a folder."""

    label: str
    pin: Pin | None  # None for a folder: nothing to pin
    wheel: Path | None = None
    tree: Path | None = None


@dataclass
class Report:
    old: str
    new: str
    patches: list[dict] = field(default_factory=list)
    forecast: list[dict] = field(default_factory=list)
    summary: str = ""
    wrapped_modules: list[dict] = field(default_factory=list)
    dependencies: dict = field(default_factory=dict)
    range_diff: str = ""
    work_tree: str = ""
    finished: bool = False
    wrote: list[str] = field(default_factory=list)

    @property
    def result(self) -> str:
        statuses = {p["status"] for p in self.patches}
        if "conflict" in statuses:
            return "conflict"
        if statuses - {"clean"} or any(m["changed"] for m in self.wrapped_modules):
            return "review"
        return "clean"

    @property
    def exit_code(self) -> int:
        return 0 if self.result == "clean" else 1


def source_from_index(version: str, name: str = "speculators") -> Source:
    """``version`` from the package index; ``latest`` is the newest release it serves."""
    tmp = Path(tempfile.mkdtemp(prefix="speculators-rebase-"))
    wheel = download(name, None if version == "latest" else version, tmp)
    version = wheel.name.split("-")[1]
    return Source(f"{name} {version} (index)", Pin(name, version, wheel.name, sha256_of(wheel)), wheel=wheel)


def source_from_wheel(path: Path) -> Source:
    if not path.is_file() or path.suffix != ".whl":
        raise ArtifactError(f"--onto-artifact {path}: not a wheel file")
    name, version = path.name.split("-")[:2]
    return Source(f"{name} {version} ({path})", Pin(name, version, path.name, sha256_of(path)), wheel=path)


def source_from_path(path: Path) -> Source:
    """An unpacked upstream tree or a source checkout (``src/speculators`` or ``speculators``)."""
    for candidate in (path / "src", path):
        if (candidate / "speculators" / "__init__.py").is_file():
            return Source(f"{path} (folder)", None, tree=candidate)
    raise ArtifactError(
        f"--onto-path {path}: no speculators package in it (looked for speculators/ and src/speculators/)"
    )


def _commit_tree(work: Path, source: Source, tag: str) -> None:
    """Replace the index with ``source``'s files and commit them as a new root commit."""
    git(work, "checkout", "-q", "--orphan", f"base-{tag}")
    git(work, "rm", "-rq", "--cached", "--ignore-unmatch", ".")
    for child in work.iterdir():
        if child.name != ".git":
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    if source.wheel is not None:
        unpack_wheel(source.wheel, work)
    else:
        shutil.copytree(
            source.tree / "speculators", work / "speculators", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        for name in ("LICENSE", "LICENSE.txt"):
            if (source.tree.parent / name).is_file() or (source.tree / name).is_file():
                shutil.copy(
                    next(p for p in (source.tree / name, source.tree.parent / name) if p.is_file()), work / "LICENSE"
                )
                break
    git(work, "add", "-A")
    git(
        work,
        "commit",
        "-q",
        "--allow-empty",
        "-m",
        f"Upstream {source.label}",
        env={"GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z"},
    )
    git(work, "tag", "-f", tag)


def _requirements(source: Source) -> set[str]:
    if source.wheel is None:
        return set()
    with zipfile.ZipFile(source.wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    return {line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")}


def _dependency_changes(old: Source, new: Source) -> dict:
    before, after = _requirements(old), _requirements(new)
    if new.wheel is None:
        return {"note": "a folder has no wheel metadata: dependencies not compared"}
    return {"added": sorted(after - before), "removed": sorted(before - after)}


def _wrapped_table(patches: Path) -> dict[str, str]:
    """{upstream module: our module that replaces or wraps it}."""
    table = patches / "wrapped-modules.json"
    if not table.exists():
        return {}
    return {
        path: ours
        for ours, paths in json.loads(table.read_text()).items()
        if not ours.startswith("_")
        for path in paths
    }


def _wrapped(work: Path, patches: Path) -> list[dict]:
    moves = upstream_moves(work, "old-upstream", "new-upstream")
    out = []
    for path, ours in _wrapped_table(patches).items():
        stat = git(work, "diff", "--stat", "old-upstream", "new-upstream", "--", path).strip()
        state = (
            ("deleted" if moves[path] is None else f"renamed to {moves[path]}")
            if path in moves
            else "changed"
            if stat
            else "unchanged"
        )
        out.append({"ours": ours, "upstream": path, "changed": bool(stat), "diffstat": stat, "upstream_state": state})
    return out


def _conflict_detail(work: Path, res: PatchResult) -> dict:
    files = res.files
    hunks = conflict_hunks(work, files, upstream_moves(work, "old-upstream", "new-upstream"))
    shown = git(work, "am", "--show-current-patch=diff", check=False)
    return {
        "files": files,
        "hunks": hunks,
        "work_tree": str(work),
        "current_patch": shown,
        "detail": res.detail[-2000:],
    }


def _save_state(work: Path, state: dict) -> None:
    (work / ".git" / STATE).write_text(json.dumps(state, indent=2))


def _load_state(work: Path) -> dict:
    path = work / ".git" / STATE
    if not path.exists():
        raise SeriesError(f"no rebase in progress in {work} (start one with 'rebase --onto VERSION')")
    return json.loads(path.read_text())


def _replay(work: Path, patches: Path, state: dict) -> Report:
    """Apply the remaining patches; stop at the first conflict."""
    report = Report(**state["report"])
    names = read_series(patches)
    while state["next"] < len(names):
        name = names[state["next"]]
        res = am(work, patches / name, three_way=True)
        status = {"clean": "clean", "3way": "3way", "empty": "already-upstream", "conflict": "conflict"}[res.status]
        entry = {"name": name, "status": status, "forecast": _forecast_of(report, name)}
        if status == "conflict":
            entry.update(_conflict_detail(work, res))
            report.patches.append(entry)
            state["report"] = asdict(report) | {"patches": report.patches[:-1]}
            state["conflicted"] = entry
            _save_state(work, state)
            report.patches += [
                {"name": n, "status": "pending", "forecast": _forecast_of(report, n)}
                for n in names[state["next"] + 1 :]
            ]
            return report
        report.patches.append(entry)
        state["next"] += 1
        state["report"] = asdict(report)
    report.range_diff = git(
        work, "range-diff", "--no-color", "old-upstream..old-series", "new-upstream..HEAD", check=False
    )
    state["report"] = asdict(report)
    _save_state(work, state)
    return report


def _finish(work: Path, patches: Path, state: dict, report: Report, dry_run: bool) -> Report:
    report.finished = True
    if dry_run:
        return report
    exported = export_series(work, base="new-upstream")
    before = {p.name: p.read_bytes() for p in patches.iterdir() if p.is_file()}
    write_series(patches, exported)
    if state.get("new_pin"):
        Pin(**state["new_pin"]).save(patches / "upstream.json")
    else:
        report.wrote.append("pin unchanged: a folder is no release artifact; rebase --onto VERSION to pin one")
    after = {p.name: p.read_bytes() for p in patches.iterdir() if p.is_file()}
    report.wrote += sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    return report


def start(work: Path, patches: Path, new: Source, dry_run: bool) -> Report:
    old_pin = Pin.load(patches / "upstream.json")
    old = Source(f"{old_pin.name} {old_pin.version} (pinned)", old_pin, wheel=fetch(old_pin))
    if work.exists():
        raise SeriesError(f"{work} exists: a rebase is in progress ('rebase --continue' or 'rebase --abort')")
    work.mkdir(parents=True)
    try:
        return _start(work, patches, old, new, dry_run)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _start(work: Path, patches: Path, old: Source, new: Source, dry_run: bool) -> Report:
    git(work, "init", "-q", "-b", "main")
    _commit_tree(work, old, "old-upstream")
    for name in read_series(patches):
        res = am(work, patches / name, three_way=False)
        if res.status == "conflict":
            shutil.rmtree(work)
            raise SeriesError(f"the current series does not apply to its own pin ({name}); run 'check'")
    git(work, "tag", "old-series")
    _commit_tree(work, new, "new-upstream")
    report = Report(old=old.label, new=new.label, work_tree=str(work))
    report.dependencies = _dependency_changes(old, new)
    report.wrapped_modules = _wrapped(work, patches)
    report.forecast = forecast(work, patches, _wrapped_table(patches))
    report.summary = summary(report.forecast)
    state = {
        "next": 0,
        "dry_run": dry_run,
        "report": asdict(report),
        "new_pin": asdict(new.pin) if new.pin else None,
        "new_wheel": str(new.wheel or ""),
    }
    report = _replay(work, patches, state)
    if any(p["status"] == "conflict" for p in report.patches):  # stopped: pending patches follow it
        return report
    return _finish(work, patches, state, report, dry_run)


def resume(work: Path, patches: Path) -> Report:
    state = _load_state(work)
    if (work / ".git" / "rebase-apply").exists():
        proc = subprocess.run(
            ["git", "-C", str(work), "am", "--continue"],
            capture_output=True,
            text=True,
            env={
                **os.environ,
                "GIT_CONFIG_GLOBAL": os.devnull,
                "GIT_COMMITTER_NAME": "speculators-v016",
                "GIT_COMMITTER_EMAIL": "patches@speculators-v016.invalid",
            },
        )
        if proc.returncode != 0:
            raise SeriesError(
                f"git am --continue failed in {work}: resolve every file and 'git add' it:\n"
                f"{(proc.stdout + proc.stderr).strip()}"
            )
    conflicted = state.pop("conflicted", None)
    report_state = state["report"]
    if conflicted:
        report_state["patches"].append({"name": conflicted["name"], "status": "resolved", "files": conflicted["files"]})
        state["next"] += 1
    state["report"] = report_state
    report = _replay(work, patches, state)
    if any(p["status"] == "conflict" for p in report.patches):  # stopped: pending patches follow it
        return report
    return _finish(work, patches, state, report, state["dry_run"])


def abort(work: Path) -> None:
    if work.exists():
        subprocess.run(["git", "-C", str(work), "am", "--abort"], capture_output=True)
        shutil.rmtree(work)


def _forecast_of(report: Report, name: str) -> dict:
    return next((f for f in report.forecast if f["name"] == name), {"status": "unknown"})


def _files(hunks: dict) -> str:
    return ", ".join(f"{f} ({n if isinstance(n, str) else f'{n} hunk(s)'})" for f, n in hunks.items())


def render(report: Report) -> str:
    lines = [f"rebase {report.old} -> {report.new}: {report.result}"]
    if report.summary:
        lines.append(f"  forecast for the whole series: {report.summary}")
    for p in report.patches:
        fc = p.get("forecast") or {}
        shown = p["status"] if p["status"] != "pending" else f"pending ({fc.get('status')})"
        lines.append(f"  {shown:26} {p['name']}")
        if p["status"] == "conflict":
            lines.append(f"      files: {_files(p['hunks'])}")
            lines.append(f"      resolve in {p['work_tree']}, git add, then: tools/patches.py rebase --continue")
        elif p["status"] == "pending" and fc.get("hunks"):
            lines.append(f"      files: {_files(fc['hunks'])}")
        lines += [f"      {m['meaning']}" for m in fc.get("moved", [])]
        lines += [f"      note: {n}" for n in fc.get("notes", [])]
    changed = [m for m in report.wrapped_modules if m["changed"]]
    lines.append(f"  upstream modules we replace or wrap: {len(changed)} changed of {len(report.wrapped_modules)}")
    for m in changed:
        last = m["diffstat"].splitlines()[-1].strip() if m["diffstat"] else ""
        state = m.get("upstream_state", "changed")
        what = state.upper() if state != "changed" else last
        lines.append(f"      {m['upstream']} ({what}) -> review {m['ours']}")
    deps = report.dependencies
    if "added" in deps:
        lines.append(f"  upstream requirements: +{len(deps['added'])} -{len(deps['removed'])}")
        lines += [f"      + {d}" for d in deps["added"]] + [f"      - {d}" for d in deps["removed"]]
    if report.range_diff:
        lines.append("  range-diff (old series vs new):")
        lines += [f"      {line}" for line in report.range_diff.splitlines()[:40]]
    if report.finished:
        lines.append(f"  wrote: {', '.join(report.wrote) or 'nothing changed in patches/'}")
    return "\n".join(lines)
