#!/usr/bin/env python3
"""What registering host memory as pinned costs a GPU engine's thread: a step loop beside a thread that pins blocks.

With rows placed by the worker (``engine.core.PLACE_ROWS``) the CLI's buffer pool registers each block it makes
with ``cudaHostRegister``, on the prefaulter's threads, while the engine's thread launches vLLM's steps and
copies. The first run so placed spent 6.6 s more in vLLM's steps than the slot path (docs/benchmarks/README.md).
Here the engine's thread is a loop of Kimi-shaped steps (a CUDA graph of matmuls at hidden 7168, a hundred small
eager launches, the captured layers' rows copied to pinned host memory, then a synchronize), timed alone and
beside a thread that, for ``--blocks`` blocks of ``--block-mib`` MiB each:

* ``touch``: faults the block in (huge pages advised, one byte a page: ``engine.prefault.touch``), no register;
* ``register``: registers the fresh block, whose pages the driver then faults in itself (the pool's order
  before this script);
* ``touch+register``: touches the block, then registers it (its pages present already);
* ``unregister``: unregisters blocks touched and registered before the window, each after a device synchronize
  (as a pinned pool drops a free block beyond what it keeps).

Printed, interleaved over ``--rounds``, medians: the loop's ms per step while the other thread ran, against
alone, and the GiB/s the thread registered or unregistered (those calls' own time). The blocks are unregistered
after each case and registered before ``unregister``'s, outside the timing.

    python tools/benchmarks/host_pinning.py [--rounds 3] [--blocks 12] [--block-mib 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from speculators_v016.engine.buffer_pool import _register, _unpin_all
from speculators_v016.engine.prefault import touch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

HIDDEN, TOKENS, LAYERS = 7168, 2048, 4
CASES = ("touch", "register", "touch+register", "unregister")


class StepLoop:
    """A stand-in for the engine's thread: graph replay, small launches, the rows' copy to the host, sync."""

    def __init__(self) -> None:
        self.x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
        self.small = torch.zeros(64, device="cuda")
        self.rows = torch.empty(LAYERS, TOKENS, HIDDEN, dtype=torch.bfloat16).pin_memory()
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            self._layers()  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph):
            self.out = self._layers()
        torch.cuda.synchronize()

    def _layers(self) -> torch.Tensor:
        h = self.x
        for _ in range(8):
            h = torch.nn.functional.silu(h @ self.w)
        return h

    def step(self) -> None:
        self.graph.replay()
        for _ in range(100):
            self.small.add_(1)
        for layer in range(LAYERS):
            self.rows[layer].copy_(self.out, non_blocking=True)
        torch.cuda.synchronize()

    def run(self, until: threading.Event | None, steps: int) -> list[float]:
        """Seconds per step: at least ``steps`` of them, and (``until``) as many as run before it is set."""
        times = []
        while len(times) < steps or (until is not None and not until.is_set()):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times


def pin_blocks(case: str, blocks: int, size: int, made: list[torch.Tensor], registering: list[float]) -> None:
    """The other thread's work for ``case``; the (un)register calls' seconds appended to ``registering``."""
    if case == "unregister":
        for block in made:
            start = time.perf_counter()
            _unpin_all([block])
            registering.append(time.perf_counter() - start)
        return
    for _ in range(blocks):
        block = torch.empty(size, dtype=torch.uint8)
        if case != "register":
            touch(block)
        if case != "touch":
            start = time.perf_counter()
            _register(block)
            registering.append(time.perf_counter() - start)
        made.append(block)


def beside(loop: StepLoop, case: str, blocks: int, size: int) -> tuple[float, float]:
    """(median ms per step while the thread ran, GiB/s (un)registered by it; 0 for touch)."""
    done, made, registering = threading.Event(), [], []
    if case == "unregister":
        pin_blocks("touch+register", blocks, size, made, [])

    def work() -> None:
        try:
            pin_blocks(case, blocks, size, made, registering)
        finally:
            done.set()

    thread = threading.Thread(target=work)
    thread.start()
    times = loop.run(done, 1)
    thread.join()
    if case in ("register", "touch+register"):
        _unpin_all(made)
    rate = len(registering) * size / sum(registering) / 2**30 if registering else 0.0
    return statistics.median(times) * 1e3, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block-mib", type=int, default=256)
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_pinning.py measures a GPU's host memory registration: no CUDA device here")
    size = opts.block_mib << 20
    loop = StepLoop()
    loop.run(None, 20)  # warm
    alone: list[float] = []
    during: dict[str, list[float]] = {case: [] for case in CASES}
    rates: dict[str, list[float]] = {case: [] for case in CASES}
    for _ in range(opts.rounds):
        alone.append(statistics.median(loop.run(None, 60)) * 1e3)
        for case in CASES:
            ms, rate = beside(loop, case, opts.blocks, size)
            during[case].append(ms)
            rates[case].append(rate)
    with recording(__file__):
        base = statistics.median(alone)
        print(f"a step loop on {torch.cuda.get_device_name(0)} (a CUDA graph of 8 matmuls [{TOKENS}, {HIDDEN}] bf16, "
              f"100 small launches, {LAYERS} x [{TOKENS}, {HIDDEN}] bf16 copied to pinned host memory, a synchronize) "
              f"beside a thread pinning {opts.blocks} blocks of {opts.block_mib} MiB; {opts.rounds} interleaved "
              "round(s), medians")  # fmt: skip
        print(f"  alone:                      {base:7.2f} ms a step (rounds: {', '.join(f'{m:.2f}' for m in alone)})")
        for case in CASES:
            ms = statistics.median(during[case])
            verb = "unregistered" if case == "unregister" else "registered"
            pinned = f", {verb} {statistics.median(rates[case]):5.2f} GiB/s" if case != "touch" else ""
            print(f"  beside {case:<20} {ms:7.2f} ms a step ({ms / base:.2f}x of alone; rounds: "
                  f"{', '.join(f'{m:.2f}' for m in during[case])}){pinned}")  # fmt: skip


if __name__ == "__main__":
    main()
