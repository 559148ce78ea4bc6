"""``python tools/patches.py``: apply, refresh and check the patch series."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from . import rebase
from .artifact import ArtifactError, Pin
from .worktree import (
    SeriesError,
    dep3_problems,
    export_series,
    has_unexported,
    mark_current,
    materialise,
    read_series,
    write_series,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORK = ROOT / "build" / "work"
PATCHES = ROOT / "patches"


def cmd_apply(args: argparse.Namespace) -> int:
    work = Path(args.work)
    if has_unexported(work) and not args.force:
        print(
            f"{work} has edits or commits not exported yet: run 'refresh' first, or pass --force to throw them away",
            file=sys.stderr,
        )
        return 1
    results = materialise(work, Path(args.patches))
    for r in results:
        print(f"{r.status:9} {r.name}")
    print(f"{work}: upstream + {len(results)} patch(es); edit, commit, then 'refresh'")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    patches = Path(args.patches)
    exported = export_series(Path(args.work))
    removed = write_series(patches, exported)
    mark_current(Path(args.work), patches)
    for name in exported:
        print(f"wrote   {name}")
    for name in removed:
        print(f"removed {name}")
    return 0


def check_series(patches: Path) -> list[str]:
    """Everything wrong with the series; an empty list means it is good."""
    problems = []
    listed = read_series(patches)
    on_disk = {p.name for p in patches.glob("*.patch")}
    problems += [f"{n}: listed in series but missing" for n in listed if n not in on_disk]
    problems += [f"{n}: not listed in series" for n in sorted(on_disk - set(listed))]
    if len(set(listed)) != len(listed):
        problems.append("series lists a patch twice")
    for name in listed:
        if name in on_disk:
            problems += dep3_problems(name, (patches / name).read_text())
    if problems:
        return problems
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        try:
            materialise(work, patches, three_way=False)  # exact context, no 3-way help
        except SeriesError as exc:
            return [str(exc)]
        for name, data in export_series(work).items():
            if name not in listed:
                problems.append(
                    f"{name}: re-export names a patch the series does not have (subject and file name disagree)"
                )
            elif (patches / name).read_bytes() != data:
                problems.append(f"{name}: stale (re-exporting it changes the file; run apply + refresh)")
    return problems


def cmd_check(args: argparse.Namespace) -> int:
    patches = Path(args.patches)
    problems = check_series(patches)
    pin = Pin.load(patches / "upstream.json")
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        return 1
    print(
        f"ok: {len(read_series(patches))} patch(es) apply exactly to {pin.name} {pin.version}, "
        "each has its DEP-3 header, none is stale"
    )
    return 0


def cmd_rebase(args: argparse.Namespace) -> int:
    work, patches = Path(args.work), Path(args.patches)
    if args.abort:
        rebase.abort(work)
        print(f"aborted: removed {work}; patches/ untouched")
        return 0
    if args.cont:
        report = rebase.resume(work, patches)
    else:
        sources = [s for s in (args.onto, args.onto_artifact, args.onto_path) if s]
        if len(sources) != 1:
            print("error: give exactly one of --onto VERSION, --onto-artifact WHEEL, --onto-path DIR", file=sys.stderr)
            return 2
        new = (
            rebase.source_from_index(args.onto)
            if args.onto
            else rebase.source_from_wheel(Path(args.onto_artifact))
            if args.onto_artifact
            else rebase.source_from_path(Path(args.onto_path))
        )
        report = rebase.start(work, patches, new, args.dry_run)
    print(json.dumps(asdict(report) | {"result": report.result}, indent=2) if args.json else rebase.render(report))
    if report.finished and not args.keep:  # nothing waits in the work tree any more
        rebase.abort(work)
    return report.exit_code


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tools/patches.py", description=__doc__)
    ap.add_argument("--patches", default=str(PATCHES), help="the series folder (default: patches/)")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("apply", help="materialise upstream + series as a git work tree")
    p.add_argument("--work", default=str(DEFAULT_WORK))
    p.add_argument("--force", action="store_true", help="discard unexported work in the tree")
    p.set_defaults(func=cmd_apply)
    p = sub.add_parser("refresh", help="export the work tree's commits back to patches/")
    p.add_argument("--work", default=str(DEFAULT_WORK))
    p.set_defaults(func=cmd_refresh)
    p = sub.add_parser("check", help="the series applies exactly, has headers, nothing stale")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("rebase", help="replay the series onto another upstream release and report")
    p.add_argument(
        "--onto", metavar="VERSION", help="an upstream release from the package index ('latest': the newest it serves)"
    )
    p.add_argument("--onto-artifact", metavar="WHEEL", help="a local upstream wheel")
    p.add_argument("--onto-path", metavar="DIR", help="an unpacked upstream tree or a source checkout")
    p.add_argument("--continue", dest="cont", action="store_true", help="carry on after resolving a conflict")
    p.add_argument("--abort", action="store_true", help="drop the rebase; patches/ stays as it was")
    p.add_argument("--dry-run", action="store_true", help="report only; never write patches/")
    p.add_argument("--json", action="store_true", help="the report as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work tree after a finished rebase")
    p.add_argument("--work", default=str(ROOT / "build" / "rebase"))
    p.set_defaults(func=cmd_rebase)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (SeriesError, ArtifactError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
