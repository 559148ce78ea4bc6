"""The command's process on a CPU build of vLLM, with glibc asked for transparent huge pages.

A CPU engine runs its forward in the command's process, and at a wide model's sizes most of its fresh
tensors are past glibc's 32 MiB mmap ceiling: each is a new mapping whose 4 KiB pages the kernel faults in,
one by one, on every step (half of a wide step's CPU time on a 2-core AVX2 EPYC; docs/benchmarks/README.md).
glibc's ``glibc.malloc.hugetlb=1`` tunable (glibc 2.35 and later) advises the kernel to back the allocator's
mappings with 2 MiB pages where the kernel's transparent huge pages are in ``madvise`` mode: 512 times fewer
faults, memory still given back when it is freed. On that EPYC the wide benchmark's command wrote 1.75x as fast
(1,295 against 738 tokens/s, medians of 3 interleaved pairs) at the same peak memory.

A tunable is read when the process starts, so :func:`reexec` starts the command again in the same process
(``execve``: the same pid, arguments, descriptors and environment, plus the tunable), before anything else
happens. It does so only where it is known to help and known to be read: Linux, glibc 2.35 or later, the
kernel's huge pages in ``madvise`` mode (``always`` gives them already, ``never`` ignores the advice), and a
CPU build of vLLM (its version ends in ``+cpu``; a GPU host's process has not been measured with it). A user's
own ``GLIBC_TUNABLES`` are kept; one that names ``glibc.malloc.hugetlb`` already is the user's choice and left
as it is. :data:`OPT_OUT` set to ``0`` leaves the process as it was started.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
#: The environment variable that turns the re-exec off (``0``); the process started again holds ``started`` in it,
#: so that it never starts again a second time, whatever becomes of ``GLIBC_TUNABLES`` on the way.
OPT_OUT = "SPECULATORS_V016_HUGE_PAGES"
STARTED = "started"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_GLIBC = (2, 35)


def thp_mode(text: str | None) -> str | None:
    """The kernel's transparent huge page mode (the bracketed word of ``enabled``), None where unreadable."""
    if not text:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def glibc_version(text: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of ``os.confstr('CS_GNU_LIBC_VERSION')`` (``glibc 2.36``), None for another libc."""
    if not text or not text.startswith("glibc "):
        return None
    try:
        major, minor = text.split()[1].split(".")[:2]
        return int(major), int(minor)
    except (IndexError, ValueError):
        return None


def plan(env: dict, *, vllm_version: str | None, thp: str | None, glibc: tuple[int, int] | None) -> str | None:
    """The ``GLIBC_TUNABLES`` value to start again with, or None (with nothing to change)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get(OPT_OUT, "1") != "1" or TUNABLE in tunables:  # off (0), or started again already
        return None
    if not vllm_version or not vllm_version.endswith("+cpu") or thp != "madvise":
        return None
    if glibc is None or glibc < MIN_GLIBC:
        return None
    return f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"


def _vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def wanted(env: dict) -> str | None:
    """:func:`plan` for this host and ``env``: the ``GLIBC_TUNABLES`` value a process started with ``env``
    should have, or None where it should be left as it is."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        libc = None
    return plan(env, vllm_version=_vllm_version(), thp=thp_mode(_read(THP_ENABLED)), glibc=glibc_version(libc))


def same_invocation(orig_argv: list[str], argv: list[str]) -> bool:
    """Whether the interpreter's own arguments end with this program's (``sys.orig_argv``, ``sys.argv``): not so
    where a host process runs the command inside itself (``runpy``, a test's warm interpreter), which starting
    again would not start the command."""
    args = argv[1:]
    return bool(args) and len(orig_argv) > len(args) and orig_argv[-len(args) :] == args


def reexec() -> None:
    """Start this process again with :data:`TUNABLE` set where :func:`wanted` says so; return where it does not.

    Call first thing in the command's entry point, before any thread or file is made."""
    orig_argv = getattr(sys, "orig_argv", None)
    if not sys.executable or not orig_argv or not same_invocation(orig_argv, sys.argv):
        return
    value = wanted(os.environ)
    if value is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(
            sys.executable,
            [sys.executable, *orig_argv[1:]],
            dict(os.environ, GLIBC_TUNABLES=value, **{OPT_OUT: STARTED}),
        )
    except OSError:  # the interpreter cannot be started again: go on as started (the summary says which pages)
        return


def asked(env: dict | None = None) -> bool:
    """Whether this process's glibc was asked for transparent huge pages (``GLIBC_TUNABLES`` holds :data:`TUNABLE`
    set to 1), by :func:`reexec` or by the user."""
    tunables = (os.environ if env is None else env).get("GLIBC_TUNABLES", "")
    return f"{TUNABLE}=1" in tunables.split(":")


def describe(huge: bool) -> str:
    """The run summary's words for :func:`asked`."""
    if huge:
        return f"glibc asked for transparent huge pages ({TUNABLE}=1; {OPT_OUT}=0 to not)"
    return f"glibc not asked for huge pages ({TUNABLE} not 1; see docs/commands/run.md)"
