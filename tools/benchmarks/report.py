"""The benchmark scripts' record: each run writes ``docs/benchmarks/<script>.md`` itself.

A script wraps the printing of its figures in ``with recording(__file__, options):``; what it
prints there goes to the terminal as before and, when the block ends without an error, becomes
the page's latest measurement (script, command, date, machine, code, figures). The measurement it
replaces moves to the top of "Earlier measurements", so a page keeps every measurement made and a
new one is a regenerated file, not an edited paragraph.

A script with a second, separately run measurement names its own page for it (``page=``): the
page of ``on_policy.py --multi-turn`` is ``on_policy_multi_turn.md``, so neither run's latest
measurement displaces the other's.

``SPECULATORS_BENCH_PAGES`` names another folder for the pages (a trial run, a test);
``SPECULATORS_BENCH_MACHINE`` adds a description of the machine that the script cannot see (a
disk, a VM, "through the device tool").
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "benchmarks"
LATEST = ("<!-- measurement:begin -->", "<!-- measurement:end -->")
EARLIER = ("<!-- earlier:begin -->", "<!-- earlier:end -->")


def pages_dir() -> Path:
    """Where the pages go: ``SPECULATORS_BENCH_PAGES`` or ``docs/benchmarks/``."""
    return Path(os.environ.get("SPECULATORS_BENCH_PAGES") or PAGES)


def machine() -> str:
    """The CPU (model, cores, AVX-512 or AVX2), the memory, a GPU if torch sees one, and the user's note."""
    model, flags = platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    parts = [f"{model}, {os.cpu_count()} cores" + (f" ({vector})" if vector else "")]
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        parts.append(f"{kib / 2**20:.0f} GiB memory")
    torch = sys.modules.get("torch")  # only if the script loaded it: never start CUDA for a description
    if torch is not None and torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}")
    note = os.environ.get("SPECULATORS_BENCH_MACHINE")
    if note:
        parts.append(note)
    return "; ".join(parts)


def code_version() -> str:
    """The checkout's commit, and whether it had local changes."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return f"{commit}{' with local changes' if dirty else ''}"


def measurement(script: str, argv: list[str], figures: str, when: datetime.datetime | None = None) -> str:
    """One measurement as markdown: a heading with the date and machine, the command, the code, the figures."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    command = shlex.join(["python", f"tools/benchmarks/{script}.py", *argv])
    return "\n".join(
        [
            f"### {when:%Y-%m-%d %H:%M} UTC",
            "",
            f"- command: `{command}`",
            f"- machine: {machine()}",
            f"- code: {code_version()}",
            "",
            "```text",
            figures.rstrip("\n"),
            "```",
        ]
    )


def _between(text: str, markers: tuple[str, str]) -> str:
    begin, end = markers
    if begin not in text or end not in text:
        return ""
    return text[text.index(begin) + len(begin) : text.index(end)].strip("\n")


def page(script: str, summary: str, latest: str, earlier: str) -> str:
    """The whole page of ``script``."""
    return "\n".join(
        [
            f"# Benchmark: `{script}.py`",
            "",
            summary,
            "",
            f"Written by `tools/benchmarks/{script}.py` itself (`tools/benchmarks/report.py`): a new run",
            "replaces the latest measurement and moves it under the earlier ones. Do not edit by hand.",
            "The machines are noisy: read the ratios, not the rates. Index: [benchmarks](README.md).",
            "",
            "## Latest measurement",
            "",
            LATEST[0],
            latest,
            LATEST[1],
            "",
            "## Earlier measurements",
            "",
            EARLIER[0],
            earlier or "(none)",
            EARLIER[1],
            "",
        ]
    )


def write_page(script: str, summary: str, argv: list[str], figures: str, name: str | None = None) -> Path:
    """Record a new measurement of ``script`` on its page (``name``.md, default ``script``.md); the previous
    latest goes first among the earlier ones."""
    path = pages_dir() / f"{name or script}.md"
    old = path.read_text() if path.exists() else ""
    previous, earlier = _between(old, LATEST), _between(old, EARLIER)
    if earlier == "(none)":
        earlier = ""
    earlier = "\n\n".join(p for p in (previous, earlier) if p)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(script, summary, measurement(script, argv, figures), earlier))
    return path


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, terminal):
        self.terminal, self.copy = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.terminal.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.terminal.flush()


@contextlib.contextmanager
def recording(script_file: str, summary: str | None = None, page: str | None = None) -> Iterator[None]:
    """Print the figures inside this block; on success they become ``script_file``'s latest measurement
    (on the page ``page``.md if given, else the script's own)."""
    script = Path(script_file).stem
    if summary is None:
        doc = sys.modules["__main__"].__doc__ or ""
        summary = doc.strip().splitlines()[0] if doc.strip() else script
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    path = write_page(script, summary, sys.argv[1:], tee.copy.getvalue(), page)
    print(f"(recorded in {path})", file=sys.stderr)
