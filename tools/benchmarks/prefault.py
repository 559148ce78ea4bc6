#!/usr/bin/env python3
"""The engine thread's copy of each step into the prompts' tensors: fresh memory, faulted in ahead, or pooled.

A GPU engine's thread copies every step's rows out of its ring slot into each prompt's own tensors
(:class:`~speculators_v016.engine.assembly.Assembler`). Here the steps are Kimi-shaped (8192 tokens, 4 layers
captured, hidden 7168, bf16: 448 MiB) and their prompts 1024-4096 tokens long, so most straddle steps; between
two steps the thread waits ``--step-ms`` as it waits for the GPU (an H200 ran such a step in about 50 ms). The
copies run on the torch threads a GPU engine gives them. Side by side, interleaved over ``--rounds``:

* ``fresh``: new tensors per prompt (the generator's default before the prefaulter);
* ``prefaulted``: the same, made and touched ahead by :class:`~speculators_v016.engine.prefault.Prefaulter`
  on threads of its own (what GPU engines do now);
* ``pooled``: a :class:`~speculators_v016.engine.buffer_pool.BufferPool`'s blocks, given back after each step
  (the CLI's way: memory touched once per run).

Printed: milliseconds of the engine thread's copy per step (median), and each against ``fresh``.

    python tools/benchmarks/prefault.py [--steps 12] [--rounds 3] [--step-ms 50] [--hidden 7168]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from speculators_v016.engine.assembly import Assembler, copy_threads, fresh_tensors
from speculators_v016.engine.buffer_pool import BufferPool
from speculators_v016.engine.prefault import prefaulter
from speculators_v016.protocol import StepCapture

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

STEP, LAYERS = 8192, 4


def plan(steps: int, seed: int = 0) -> tuple[list[int], list[list[tuple[int, int, int]]]]:
    """Prompt lengths and, per step, ``(prompt, start, rows)`` pieces filling 8192 tokens in admission order."""
    rng = random.Random(seed)
    lengths, pieces, todo = [], [], []
    for _ in range(steps):
        step, room = [], STEP
        while room:
            if not todo:
                lengths.append(rng.randint(1024, 4096))
                todo = [len(lengths) - 1, 0]
            prompt, start = todo
            rows = min(room, lengths[prompt] - start)
            step.append((prompt, start, rows))
            room -= rows
            todo = [prompt, start + rows] if start + rows < lengths[prompt] else []
        pieces.append(step)
    return lengths, pieces


def one_pass(kind: str, source: torch.Tensor, lengths, pieces, step_ms: float, pool: BufferPool) -> float:
    """Median ms of the engine thread's copy per step."""
    allocate = pool.take if kind == "pooled" else fresh_tensors
    ahead = prefaulter(allocate, copy_threads("cuda")) if kind == "prefaulted" else None
    asm = Assembler(tuple(range(LAYERS)), allocate, copy_threads=copy_threads("cuda"), prefault=ahead)
    for i, n in enumerate(lengths):
        asm.add_request(f"r{i}", i, n)
    times, kept = [], []
    try:
        for number, step in enumerate(pieces, 1):
            time.sleep(step_ms / 1e3)  # the GPU's step, while the prefaulter's threads work
            asm.expect(number, {f"r{p}": (s, n) for p, s, n in step})
            capture = StepCapture(number, [f"r{p}" for p, _, _ in step], [s for _, s, _ in step],
                                  [n for *_, n in step], states=source)  # fmt: skip
            start = time.perf_counter()
            asm.add(capture)
            times.append((time.perf_counter() - start) * 1e3)
            done = asm.pop_complete()
            if kind == "pooled":
                for _, states in done:
                    pool.give_back(states)
            else:
                kept = (kept + done)[-8:]  # a caller holds a few samples, as a writer's queue does
    finally:
        if ahead is not None:
            ahead.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=50.0, help="the GPU's step: the engine thread waits this long")
    ap.add_argument("--hidden", type=int, default=7168)
    opts = ap.parse_args()
    source = torch.randn(LAYERS, STEP, opts.hidden).to(torch.bfloat16)
    lengths, pieces = plan(opts.steps)
    pool = BufferPool()
    kinds = ["fresh", "prefaulted", "pooled"]
    one_pass("pooled", source, lengths, pieces, opts.step_ms, pool)  # the pool's blocks made once, as in a run
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(opts.rounds):
        for kind in kinds:
            runs[kind].append(one_pass(kind, source, lengths, pieces, opts.step_ms, pool))
    fresh = statistics.median(runs["fresh"])
    with recording(__file__):
        print(
            f"{opts.steps} steps of {STEP} tokens x {LAYERS} layers x {opts.hidden} bf16 "
            f"({LAYERS * STEP * opts.hidden * 2 / 2**20:.0f} MiB), prompts of 1024-4096 tokens, {opts.step_ms:.0f} ms "
            f"between steps, copies on {copy_threads('cuda')} torch thread(s), {opts.rounds} interleaved rounds, medians"
        )
        for kind in kinds:
            ms = statistics.median(runs[kind])
            rounds = ", ".join(f"{x:.0f}" for x in runs[kind])
            print(f"  {kind:11} {ms:6.1f} ms per step (rounds: {rounds}); {fresh / ms:.2f}x faster than fresh")


if __name__ == "__main__":
    main()
