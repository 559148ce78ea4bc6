"""PEP 517 backend: assemble upstream + our series, then build with setuptools.

Before any build hook runs, ``build/work`` must hold pristine upstream with
``patches/series`` applied (the same work tree ``tools/patches.py apply``
makes), plus a link to our own package ``speculators_v016``; setup.cfg then
packages everything under ``build/work``. A tree that is already current is
reused, and a tree holding unexported edits is never overwritten.
"""

from __future__ import annotations

import os
from pathlib import Path

from patchtool.worktree import UPSTREAM_TAG, SeriesError, git, has_unexported, is_current, materialise
from setuptools import build_meta as _setuptools

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "work"
PATCHES = ROOT / "patches"
OURS = "speculators_v016"
MODIFIED_NOTICE = "MODIFIED-FILES.txt"


def _write_modified_notice(work: Path) -> None:
    """Apache-2.0 section 4(b): say which upstream files our patches changed."""
    changed = git(work, "diff", "--name-status", "--find-renames", UPSTREAM_TAG, "HEAD").strip()
    subjects = git(work, "log", "--reverse", "--format=  - %s", f"{UPSTREAM_TAG}..HEAD").rstrip()
    text = (
        "The upstream files below were modified by speculators-v016 (status, path):\n\n"
        f"{changed or '(none)'}\n\nby these patches, in order:\n{subjects or '  (none)'}\n"
    )
    (work / MODIFIED_NOTICE).write_text(text)


def assemble() -> Path:
    if not is_current(WORK, PATCHES):
        if has_unexported(WORK):
            raise SeriesError(
                f"{WORK} holds edits that are not exported to patches/: run "
                "'python tools/patches.py refresh' (or remove the folder) before building"
            )
        materialise(WORK, PATCHES)
    link = WORK / OURS
    if not link.is_symlink():
        os.symlink(os.path.relpath(ROOT / OURS, WORK), link)
    _write_modified_notice(WORK)
    return WORK


def _assembled(hook):
    def wrapper(*args, **kwargs):
        assemble()
        return hook(*args, **kwargs)

    wrapper.__name__ = hook.__name__
    return wrapper


get_requires_for_build_wheel = _assembled(_setuptools.get_requires_for_build_wheel)
get_requires_for_build_editable = _assembled(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_wheel = _assembled(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _assembled(_setuptools.prepare_metadata_for_build_editable)
build_wheel = _assembled(_setuptools.build_wheel)
build_editable = _assembled(_setuptools.build_editable)
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
build_sdist = _setuptools.build_sdist
