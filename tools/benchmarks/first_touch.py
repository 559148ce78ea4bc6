#!/usr/bin/env python3
"""What a fresh process pays to touch new memory, by how long ago another process gave the same amount back.

Issue 53: the wide CPU CLI's first steps grow its heap by about 2 GB, and on the CI's VMs that growth cost
2.6-5 CPU-s a GB (``perf``: the kernel zeroing pages on first touch). This measures the machine, not the
generator: a child process maps ``--gib`` GiB of anonymous memory and writes one byte into each 4 KiB page
(``4k``; ``huge``: the mapping advised ``MADV_HUGEPAGE`` first), timed; just before, another child touched and
freed as much, then the parent waited ``--delays`` seconds ("after 0 s": the timed child's own start-up, some
tens of milliseconds). The timed child's memory is whatever the kernel hands it, not necessarily the pages the
first child freed; on a machine with most memory free, the delay says how long the freed memory has been free.
A host that keeps the guest's freed pages shows one rate at every delay. A VM whose balloon reports free pages to its host (virtio-balloon's free page
reporting, feature bit 5, ``page_reporting_order`` in ``/sys/module/page_reporting/parameters``) gets them
back only after the host backs them again: fast at once, slow a few seconds later. A long run keeps its heap
(``run/huge_pages.py``) and pays it once; a short benchmark run pays it in its first steps.

    python tools/benchmarks/first_touch.py [--gib 2] [--delays 0 1 3 10 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

PAGE = 4096


def touch(gib: float, huge: bool) -> float:
    """Seconds to write one byte into each 4 KiB page of a new ``gib`` GiB anonymous mapping."""
    size = int(gib * (1 << 30))
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        area.madvise(mmap.MADV_HUGEPAGE)
    start = time.perf_counter()
    for offset in range(0, size, PAGE):
        area[offset] = 1
    seconds = time.perf_counter() - start
    area.close()
    return seconds


def child(gib: float, huge: bool) -> float:
    """The seconds :func:`touch` took in a process of its own (a fresh address space, as a new run's)."""
    out = subprocess.run([sys.executable, __file__, "--child", str(gib), "huge" if huge else "4k"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return float(out.stdout)


def reporting() -> str:
    """Whether this machine's virtio balloon reports free pages to its host, at what order, and the kernel's
    transparent huge page mode (``never``: the huge row measures 4 KiB pages too)."""
    parts = []
    for features in sorted(Path("/sys/bus/virtio/drivers/virtio_balloon").glob("virtio*/features")):
        bits = features.read_text().strip()
        parts.append(f"virtio-balloon free page reporting {'on' if len(bits) > 5 and bits[5] == '1' else 'off'}")
    path = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    if path.is_file():
        order = int(path.read_text())
        parts.append(f"page_reporting_order {order} ({(PAGE << order) >> 10} KiB)")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    words = thp.read_text().split() if thp.is_file() else []
    mode = next((w[1:-1] for w in words if w.startswith("[")), "unknown")
    parts.append(f"transparent huge pages: {mode}")
    return "; ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="GiB each child touches (and the one before frees)")
    ap.add_argument("--delays", type=float, nargs="+", default=[0, 1, 3, 10, 30], help="seconds between")
    ap.add_argument("--rounds", type=int, default=2)
    opts = ap.parse_args()
    if opts.gib <= 0 or any(d < 0 for d in opts.delays) or opts.rounds < 1:
        ap.error("--gib must be positive, --delays not negative, --rounds at least 1")
    rates: dict[tuple[str, float], list[float]] = {}
    for _ in range(opts.rounds):
        for kind in ("4k", "huge"):
            for delay in opts.delays:
                child(opts.gib, kind == "huge")  # memory touched, then given back as the child exits
                time.sleep(delay)
                seconds = child(opts.gib, kind == "huge")
                rates.setdefault((kind, delay), []).append(opts.gib * (1 << 30) / seconds / 1e9)
                print(f"{kind} after {delay:g} s: {rates[kind, delay][-1]:.2f} GB/s", file=sys.stderr, flush=True)
    with recording(__file__):
        print(f"{opts.gib:g} GiB first touched by a fresh process (a byte a 4 KiB page), a process having touched and "
              f"freed as much the given seconds before; GB/s, median of {opts.rounds} rounds; {reporting()}")  # fmt: skip
        print(f"{'pages':6} " + " ".join(f"{f'after {d:g} s':>12}" for d in opts.delays))
        for kind in ("4k", "huge"):
            line = " ".join(f"{statistics.median(rates[kind, d]):12.2f}" for d in opts.delays)
            print(f"{kind:6} {line}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(touch(float(sys.argv[2]), sys.argv[3] == "huge"))
    else:
        main()
