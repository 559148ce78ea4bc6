#!/usr/bin/env python3
"""One sample writer beside a thread that runs Python without pause: what the GIL costs the writers.

The run's writers hash, test and write each sample in C calls that release the GIL, and take it back
between them: the system calls of a file (open, write, fsync, rename...), and per tensor the hash and
the NaN/Inf test, 4 MiB at a time (about three trips a chunk), and the degenerate-row screen. A
thread that runs Python code without pause (vLLM's engine thread between its waits, on a GPU host)
keeps the GIL until the interpreter's switch interval forces it to hand it over (5 ms by default): each
time the writer takes the GIL back it may wait that long.
Printed, for each switch interval and chunk size (whole tensors, then the run's own, 4 MiB): GiB/s of
samples made durable by one writer alone and beside such a thread (interleaved over --rounds, medians),
and the ratio.

The samples are Kimi-shaped (4 layers x 7168, bf16, 1536-2560 tokens), in the run's buffer pool,
written with the run's checks (NaN/Inf on each chunk, the degenerate-row screen) into --dir.

    python tools/benchmarks/writer_gil.py [--dir /dev/shm] [--rounds 3] [--samples 6]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from speculators_v016.checks.finite import non_finite_reason
from speculators_v016.checks.self_check import WriterScreen
from speculators_v016.engine.buffer_pool import BufferPool
from speculators_v016.store import atomic_files
from speculators_v016.store.sample_format import DATA_ALIGN
from speculators_v016.store.writer import SampleWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

HIDDEN = 7168
LAYER_IDS = [2, 30, 57, 60]  # as a 61-layer Kimi-K2.5 run would record them
INTERVALS = (0.005, 0.001, 0.0002)  # s: the interpreter's default, then shorter
CHUNKS = (1 << 30, atomic_files.WRITE_CHUNK)  # whole tensors, then the writer's chunk (store/atomic_files.py)


def make_samples(count: int) -> list[dict]:
    """``count`` samples of random bf16 states, each layer in one pool block as the run lays them out."""
    pool, rng, samples = BufferPool(align=DATA_ALIGN), random.Random(0), []
    for _ in range(count):
        n = rng.randint(1536, 2560)
        layers = pool.take([((n, HIDDEN), torch.bfloat16)] * len(LAYER_IDS))
        for layer in layers:
            layer.normal_()
        samples.append({"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
                        "hidden_states": layers})  # fmt: skip
    return samples


def write_all(samples: list[dict], folder: Path, busy_thread: bool) -> float:
    """GiB/s of ``samples`` made durable by one writer, beside a thread that runs Python without pause or not."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1  # pure Python: holds the GIL until the switch interval takes it away

    spinner = threading.Thread(target=spin, daemon=True)
    if busy_thread:
        spinner.start()
    target = Path(tempfile.mkdtemp(dir=folder))
    try:
        start = time.perf_counter()
        writer = SampleWriter(target, "safetensors", LAYER_IDS, workers=1, non_finite=non_finite_reason(LAYER_IDS),
                              screen=WriterScreen(LAYER_IDS))  # fmt: skip
        for index, sample in enumerate(samples):
            writer.put(index, sample)
        writer.close()
        seconds = time.perf_counter() - start
        if writer.written != len(samples):
            raise RuntimeError("the writer did not write every sample")
        return writer.bytes / seconds / 2**30
    finally:
        stop.set()
        if busy_thread:
            spinner.join()
        shutil.rmtree(target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm", help="folder to write in (a temporary folder inside)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--samples", type=int, default=6)
    opts = ap.parse_args()
    samples = make_samples(opts.samples)
    size = sum(sum(t.numel() * t.element_size() for t in s["hidden_states"]) for s in samples) / 2**30
    rates: dict[tuple[float, int, bool], list[float]] = {}
    chunk_before, interval_before = atomic_files.WRITE_CHUNK, sys.getswitchinterval()
    try:
        for _ in range(opts.rounds):
            for interval in INTERVALS:
                for chunk in CHUNKS:
                    sys.setswitchinterval(interval)
                    atomic_files.WRITE_CHUNK = chunk
                    for busy in (False, True):
                        rates.setdefault((interval, chunk, busy), []).append(write_all(samples, Path(opts.dir), busy))
    finally:
        atomic_files.WRITE_CHUNK = chunk_before
        sys.setswitchinterval(interval_before)
    with recording(__file__):
        print(f"{opts.samples} samples of 1536-2560 tokens x {len(LAYER_IDS)} layers x {HIDDEN} bf16 ({size:.2f} GiB), "
              f"one writer (NaN/Inf test and degenerate-row screen on), folder on {opts.dir}, {opts.rounds} "
              "interleaved round(s), medians; 'beside Python': a thread running Python without pause")  # fmt: skip
        for interval in INTERVALS:
            for chunk in CHUNKS:
                alone = statistics.median(rates[(interval, chunk, False)])
                beside = statistics.median(rates[(interval, chunk, True)])
                piece = "whole tensors" if chunk >= 1 << 30 else f"{chunk >> 20} MiB"
                print(f"  switch interval {interval * 1e3:4.1f} ms, chunks: {piece:>13}: alone "
                      f"{alone:5.2f} GiB/s, beside Python {beside:5.2f} GiB/s ({beside / alone:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
