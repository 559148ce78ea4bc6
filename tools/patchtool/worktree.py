"""Upstream + patch series as a git work tree, and the series exported back.

The work tree's first commit is pristine upstream (tagged ``upstream``); each
patch of ``patches/series`` is one commit on top, applied with ``git am``.
Exporting runs ``git format-patch`` with flags that keep the output stable, so
re-exporting an unchanged series changes no byte.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .artifact import Pin, fetch, unpack_wheel

UPSTREAM_TAG = "upstream"
STAMP = "speculators-v016-series"  # file under .git/: which series the tree was built from
DEP3_FIELDS = ("Description", "Origin", "Forwarded", "Last-Update")
BUILD_LEFTOVERS = ("*.egg-info/", "__pycache__/", "*.pyc", "/speculators_v016", "/MODIFIED-FILES.txt")

# A fixed identity and clock for the commits we make, so the tree is reproducible.
_ENV = {
    "GIT_AUTHOR_NAME": "speculators-v016",
    "GIT_AUTHOR_EMAIL": "patches@speculators-v016.invalid",
    "GIT_COMMITTER_NAME": "speculators-v016",
    "GIT_COMMITTER_EMAIL": "patches@speculators-v016.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1",
}
# Flags that make format-patch output independent of the local git config.
FORMAT_FLAGS = [
    "--no-stat",
    "--zero-commit",
    "--full-index",
    "--no-signature",
    "--keep-subject",
    "--no-encode-email-headers",
    "--find-renames",
    "--diff-algorithm=myers",
    "-U3",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--no-notes",
    "--no-binary",
]


class SeriesError(RuntimeError):
    """The patch series or the work tree is not in the state asked for."""


def git(work: Path, *args: str, check: bool = True, env: dict | None = None) -> str:
    full_env = {**os.environ, **_ENV, "GIT_CONFIG_GLOBAL": os.devnull, **(env or {})}
    proc = subprocess.run(["git", "-C", str(work), *args], capture_output=True, text=True, env=full_env)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} failed in {work}:\n{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def read_series(patches: Path) -> list[str]:
    """Names listed in ``patches/series``, in order (``#`` starts a comment)."""
    names = []
    for line in (patches / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def series_fingerprint(patches: Path) -> str:
    """Hash of the pin, the series and every listed patch: what a tree was built from."""
    digest = hashlib.sha256((patches / "upstream.json").read_bytes())
    digest.update((patches / "series").read_bytes())
    for name in read_series(patches):
        digest.update(name.encode() + b"\0" + (patches / name).read_bytes())
    return digest.hexdigest()


def init_pristine(work: Path, wheel: Path, pin: Pin) -> None:
    """Create ``work`` as a git repository holding pristine upstream (one commit)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    unpack_wheel(wheel, work)
    git(work, "init", "-q", "-b", "main")
    # What builds and installs leave in the tree is never part of a patch.
    (work / ".git" / "info" / "exclude").write_text("\n".join(BUILD_LEFTOVERS) + "\n")
    git(work, "add", "-A")
    date = {"GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z"}
    git(
        work,
        "commit",
        "-q",
        "-m",
        f"Upstream {pin.name} {pin.version} ({pin.filename})\n\nsha256: {pin.sha256}",
        env=date,
    )
    git(work, "tag", UPSTREAM_TAG)


@dataclass
class PatchResult:
    name: str
    status: str  # "clean", "3way", "empty", "conflict"
    files: list[str] = field(default_factory=list)
    detail: str = ""


def am(work: Path, patch: Path, three_way: bool) -> PatchResult:
    """Apply one patch as a commit; on failure leave the am session open."""
    head = git(work, "rev-parse", "HEAD").strip()
    args = ["am", "--keep", "--keep-cr", "--committer-date-is-author-date"]
    if three_way:
        args.append("--3way")
    proc = subprocess.run(
        ["git", "-C", str(work), *args, str(patch)],
        capture_output=True,
        text=True,
        env={**os.environ, **_ENV, "GIT_CONFIG_GLOBAL": os.devnull},
    )
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        if git(work, "rev-parse", "HEAD").strip() == head:  # merged to nothing: already upstream
            return PatchResult(patch.name, "empty", detail=out.strip())
        status = "3way" if "Falling back to patching base and 3-way merge" in out else "clean"
        return PatchResult(patch.name, status)
    if "Patch is empty" in out or "No changes -- Patch already applied" in out:
        git(work, "am", "--skip")
        return PatchResult(patch.name, "empty", detail=out.strip())
    conflicted = git(work, "diff", "--name-only", "--diff-filter=U", check=False).split()
    if not conflicted:  # plain apply failure (no 3-way): the files the patch touches
        conflicted = re.findall(r"^error: patch failed: (\S+?):\d+", out, re.M)
    return PatchResult(patch.name, "conflict", conflicted, out.strip())


def apply_series(work: Path, patches: Path, *, three_way: bool, stop_on_conflict: bool = True) -> list[PatchResult]:
    results = []
    for name in read_series(patches):
        path = patches / name
        if not path.is_file():
            raise SeriesError(f"patches/series lists {name}, but patches/{name} does not exist")
        res = am(work, path, three_way)
        results.append(res)
        if res.status == "conflict" and stop_on_conflict:
            break
    return results


def materialise(work: Path, patches: Path, *, three_way: bool = True) -> list[PatchResult]:
    """Pristine upstream + the whole series in ``work``; raise on a conflict."""
    pin = Pin.load(patches / "upstream.json")
    init_pristine(work, fetch(pin), pin)
    results = apply_series(work, patches, three_way=three_way)
    bad = [r for r in results if r.status == "conflict"]
    if bad:
        raise SeriesError(
            f"patch {bad[0].name} does not apply to {pin.name} {pin.version} "
            f"(files: {', '.join(bad[0].files) or '?'}); the am session waits in {work}\n"
            f"{bad[0].detail}"
        )
    mark_current(work, patches)
    return results


def mark_current(work: Path, patches: Path) -> None:
    """Record that ``work``'s HEAD is exactly the series in ``patches`` (after apply or refresh)."""
    head = git(work, "rev-parse", "HEAD").strip()
    (work / ".git" / STAMP).write_text(f"{series_fingerprint(patches)} {head}\n")


def _stamp(work: Path) -> list[str]:
    path = work / ".git" / STAMP
    return path.read_text().split() if path.is_file() else []


def is_current(work: Path, patches: Path) -> bool:
    """``work`` holds exactly the series in ``patches``, with nothing added since."""
    stamp = _stamp(work)
    return len(stamp) == 2 and stamp[0] == series_fingerprint(patches) and not has_unexported(work)


def has_unexported(work: Path) -> bool:
    """Edits or commits in ``work`` made after its last apply or refresh."""
    if not (work / ".git").is_dir():
        return False
    if git(work, "status", "--porcelain", "--untracked-files=no").strip():
        return True
    stamp = _stamp(work)
    return len(stamp) != 2 or stamp[1] != git(work, "rev-parse", "HEAD").strip()


def export_series(work: Path, base: str = UPSTREAM_TAG) -> dict[str, bytes]:
    """The commits after ``base`` as patch files: {file name: content}, in order."""
    if (work / ".git" / "rebase-apply").exists():
        raise SeriesError(f"a git am session is open in {work}: finish it (git am --continue) first")
    with tempfile.TemporaryDirectory() as tmp:
        git(work, "format-patch", *FORMAT_FLAGS, "-o", tmp, f"{base}..HEAD")
        out: dict[str, bytes] = {}
        for path in sorted(Path(tmp).glob("*.patch")):
            name = re.sub(r"^\d{4}-", "", path.name)
            if name in out:
                raise SeriesError(f"two patches would be named {name}: give them different subjects")
            out[name] = path.read_bytes()
    return out


def write_series(patches: Path, exported: dict[str, bytes]) -> list[str]:
    """Replace the series in ``patches/`` by ``exported``; return the names removed."""
    old = set(read_series(patches)) if (patches / "series").exists() else set()
    for name, data in exported.items():
        target = patches / name
        if not target.exists() or target.read_bytes() != data:
            target.write_bytes(data)
    removed = sorted(old - set(exported))
    for name in removed:
        (patches / name).unlink(missing_ok=True)
    header = "# Applied in this order onto the pinned upstream release (upstream.json).\n"
    (patches / "series").write_text(header + "".join(f"{n}\n" for n in exported))
    return removed


def dep3_problems(name: str, text: str) -> list[str]:
    """Missing DEP-3 fields in the message part of a patch."""
    message = text.split("\n---\n", 1)[0]
    return [
        f"{name}: no DEP-3 '{f}:' field" for f in DEP3_FIELDS if not re.search(rf"^{re.escape(f)}: \S", message, re.M)
    ]
