"""The command's process on a CPU build of vLLM, with glibc asked for transparent huge pages and a kept heap.

A CPU engine runs its forward in the command's process, and at a wide model's sizes most of its fresh
tensors are past glibc's 32 MiB mmap ceiling: each is a new mapping whose pages the kernel faults in and
zeroes, on every step (half of a wide step's CPU time on a 2-core AVX2 EPYC with 4 KiB pages;
docs/benchmarks/README.md). Two sets of glibc tunables take that away:

* ``glibc.malloc.hugetlb=1`` (glibc 2.35 and later) advises the kernel to back the allocator's memory with
  2 MiB pages where its transparent huge pages are in ``madvise`` mode: 512 times fewer faults. On that EPYC
  the wide benchmark's command wrote 1.75x as fast (1,295 against 738 tokens/s) at the same peak memory.
* :data:`HEAP` (glibc 2.36 and later: the one measured) keeps such tensors in glibc's heap: allocations below
  1 GiB come from it instead of mappings of their own, and up to 2 GiB freed at its top stays there, so the next
  step reuses memory already faulted in and zeroed once. A 2 MiB page is still zeroed on each fresh fault, and the
  capture's own fresh tensors (vLLM's aux sums, the samples) made that zeroing what the generator paid beyond
  ``LLM.generate`` (issue 53: ``clear_page_erms`` +863 of +1,863 perf samples). The cost: the process keeps
  the heap its busiest step needed, and a run's samples interleaved with the forward's tensors fragment it
  (docs/benchmarks/README.md gives the peak memory beside the rates).

A tunable is read when the process starts, so :func:`reexec` starts the command again in the same process
(``execve``: the same pid, arguments, descriptors and environment, plus the tunables), before anything else
happens; every process the command starts (a multiprocess executor's workers, write helpers) inherits them. It
does so only on Linux with glibc and a CPU build of vLLM (its version ends in ``+cpu``; a GPU host's process has
not been measured with them); huge pages only where the kernel's are in ``madvise`` mode
(``always`` gives them already, ``never`` ignores the advice). A user's own ``GLIBC_TUNABLES`` are kept, and a
tunable they name (or its ``MALLOC_*_`` variable, :data:`ALIASES`) is their choice, left as it is.
:data:`OPT_OUT` set to ``0`` leaves the process as it was started.
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
#: glibc's heap kept between steps: allocations below 1 GiB from the heap, up to 2 GiB freed at its top kept there.
HEAP = {"glibc.malloc.mmap_threshold": str(1 << 30), "glibc.malloc.trim_threshold": str(2 << 30)}
#: The glibc measured with :data:`HEAP`: older ones (2.33 and 2.34 at least) refuse an mmap threshold above 32 MiB,
#: and the trim threshold alone would then fix theirs at 128 KiB, more fresh mappings than glibc's own choice.
MIN_GLIBC_HEAP = (2, 36)
#: The environment variables glibc reads for the same settings (``MALLOC_MMAP_THRESHOLD_``): a user's is their choice.
ALIASES = {
    "MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold",
    "MALLOC_TRIM_THRESHOLD_": "glibc.malloc.trim_threshold",
}
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
    if env.get(OPT_OUT, "1") != "1":  # off (0), or started again already
        return None
    if not vllm_version or not vllm_version.endswith("+cpu") or glibc is None:
        return None
    wanted = {TUNABLE: "1"} if thp == "madvise" and glibc >= MIN_GLIBC else {}
    wanted |= HEAP if glibc >= MIN_GLIBC_HEAP else {}
    named = set(given(tunables)) | {name for alias, name in ALIASES.items() if alias in env}
    added = [f"{name}={value}" for name, value in wanted.items() if name not in named]
    return ":".join([tunables, *added] if tunables else added) if added else None


def given(tunables: str) -> dict[str, str]:
    """``GLIBC_TUNABLES``' names and values (``a=1:b=2``)."""
    pairs = (item.partition("=") for item in tunables.split(":") if item)
    return {name: value for name, _, value in pairs}


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
    """Start this process again with the tunables :func:`wanted` names; return where it names none.

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


def heap_kept(tunables: str) -> bool:
    """Whether ``GLIBC_TUNABLES`` keep glibc's heap as :data:`HEAP` does (fresh tensors below 1 GiB then reuse it)."""
    have = given(tunables)
    return all(have.get(name) == value for name, value in HEAP.items())


def describe(tunables: str) -> str:
    """The run summary's words for what of :func:`plan`'s the process's ``GLIBC_TUNABLES`` hold."""
    have = given(tunables)
    parts = ["transparent huge pages"] if have.get(TUNABLE) == "1" else []
    if heap_kept(tunables):
        parts.append("a kept heap")
    if parts:
        return f"glibc asked for {' and '.join(parts)} ({OPT_OUT}=0 to not)"
    return "glibc not asked for huge pages nor a kept heap (see docs/commands/run.md)"
