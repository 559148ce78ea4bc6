"""What replaying each patch of the series onto a new upstream release would do, all at once.

The forecast runs in a scratch work tree (``git worktree``) checked out at the
new release and replays the whole series there with ``git am --3way``, one
patch at a time: a patch that conflicts is recorded and set aside (``am
--abort``), so every later patch is still tried, on top of the earlier ones
that applied. Each patch ends ``clean``, ``3way``, ``already-upstream`` or
``conflict`` (files and hunk counts; files upstream deleted are named as
such), and is marked ``target-deleted`` or ``target-renamed`` when upstream
removed or moved a file it changes. A patch that touches a file an earlier
conflicting patch touched carries a note: its forecast assumes that one
unresolved.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from .worktree import am, git, read_series

SUMMARY_ORDER = ["conflict", "target-deleted", "target-renamed", "3way", "already-upstream", "clean"]


def upstream_moves(work: Path, old: str, new: str) -> dict[str, str | None]:
    """Files of ``old`` that ``new`` deleted (None) or renamed (new path)."""
    out = git(work, "diff", "--name-status", "-M", "--no-color", old, new).splitlines()
    moves: dict[str, str | None] = {}
    for line in out:
        parts = line.split("\t")
        if parts[0] == "D":
            moves[parts[1]] = None
        elif parts[0].startswith("R"):
            moves[parts[1]] = parts[2]
    return moves


def touched_files(patch: Path) -> list[str]:
    """Pre-image paths a patch changes (renamed or deleted files included; new files not)."""
    text = patch.read_text(errors="replace")
    found = []
    for block in re.split(r"^diff --git ", text, flags=re.M)[1:]:
        head = block.split("\n@@", 1)[0]
        if "\nnew file mode" in head:
            continue
        rename = re.search(r"^rename from (.+)$", head, re.M)
        path = rename.group(1) if rename else re.match(r"a/(\S+) b/", block).group(1)
        found.append(path)
    return found


def all_paths(patch: Path) -> set[str]:
    """Every path a patch names, on either side (created files included)."""
    text = patch.read_text(errors="replace")
    return {p for pair in re.findall(r"^diff --git a/(\S+) b/(\S+)$", text, re.M) for p in pair}


def meaning(path: str, moved_to: str | None, wrapped: dict[str, str]) -> str:
    """What an upstream deletion or rename means for us, in one sentence."""
    if path in wrapped:
        what = (
            f"upstream {'removed' if moved_to is None else f'moved to {moved_to}'} the module {wrapped[path]} replaces"
        )
        return f"{what}: the patch (and any redirect to our module) must move or go"
    if moved_to is None:
        return f"upstream removed {path}: the patch must move to where that code went, or go"
    return f"upstream renamed {path} to {moved_to}: the patch must follow it"


def forecast(
    work: Path, patches: Path, wrapped: dict[str, str], new_ref: str = "new-upstream", old_ref: str = "old-upstream"
) -> list[dict]:
    """One entry per patch of the series: name, status, files, hunks, targets moved upstream, notes."""
    moves = upstream_moves(work, old_ref, new_ref)
    scratch = Path(tempfile.mkdtemp(prefix="speculators-forecast-")) / "tree"
    git(work, "worktree", "add", "-q", "--detach", str(scratch), new_ref)
    entries, conflicted_files = [], {}
    try:
        for name in read_series(patches):
            res = am(scratch, patches / name, three_way=True)
            status = {"clean": "clean", "3way": "3way", "empty": "already-upstream", "conflict": "conflict"}[res.status]
            entry = {"name": name, "status": status, "files": [], "hunks": {}, "moved": [], "notes": []}
            if status == "conflict":
                entry["files"] = res.files
                entry["hunks"] = conflict_hunks(scratch, res.files, moves)
                git(scratch, "am", "--abort", check=False)
            targets = touched_files(patches / name)
            for path in targets:
                if path in moves:
                    entry["moved"].append(
                        {"path": path, "to": moves[path], "meaning": meaning(path, moves[path], wrapped)}
                    )
            if entry["moved"] and status != "already-upstream":
                entry["status"] = "target-deleted" if any(m["to"] is None for m in entry["moved"]) else "target-renamed"
            named = all_paths(patches / name)
            earlier = sorted({n for f in named for n in conflicted_files.get(f, [])})
            if earlier:
                entry["notes"].append(
                    f"touches files of {', '.join(earlier)}, which does not apply: this "
                    "forecast assumes that patch unresolved"
                )
            if entry["status"] in ("conflict", "target-deleted", "target-renamed"):
                for path in named:
                    conflicted_files.setdefault(path, []).append(name)
            entries.append(entry)
    finally:
        git(work, "worktree", "remove", "--force", str(scratch), check=False)
        shutil.rmtree(scratch.parent, ignore_errors=True)
        git(work, "worktree", "prune", check=False)
    return entries


def conflict_hunks(tree: Path, files: list[str], moves: dict[str, str | None]) -> dict[str, int | str]:
    """Conflict markers per file; a file upstream deleted or renamed is named so, not '0 hunks'."""
    hunks: dict[str, int | str] = {}
    for name in files:
        if name in moves:
            hunks[name] = "deleted upstream" if moves[name] is None else f"renamed upstream to {moves[name]}"
            continue
        path = tree / name
        hunks[name] = path.read_text(errors="replace").count("<<<<<<<") if path.is_file() else "missing"
    return hunks


def summary(entries: list[dict]) -> str:
    """e.g. ``1 conflict, 4 clean, 1 target deleted``."""
    counts = Counter(e["status"] for e in entries)
    return ", ".join(f"{counts[s]} {s.replace('-', ' ')}" for s in SUMMARY_ORDER if counts[s])
