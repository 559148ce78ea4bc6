#!/usr/bin/env python3
"""Worker-to-engine transport of one step's captured states, three ways, side by side.

Each step is one request/reply between this process (the engine) and a worker
process, over vLLM's own ``MessageQueue`` (the channel vLLM's multiprocess
executor uses for RPCs and their replies), with two steps in flight as the
engine runs them (the next request is sent before the current reply is
consumed), over ``--steps`` steps a measurement:

* (a) **RPC return value** (the path before the ring): the worker replies with a
  host tensor holding the step; vLLM pickles it, sends it over its local
  socket, the engine unpickles it.
* (b) **slot ring**: the step is already in a shared ring slot (on GPUs the
  device-to-host copy writes it there); the reply carries metadata only and
  the engine copies the rows once into fresh per-request tensors (what the
  assembler does), then gives the slot back.
* (b+) the same, plus a CPU worker's own copy into the slot first (what CPU
  workers pay; on GPUs that copy is the DMA).
* (c) the ceiling: an in-process copy of the same bytes into fresh tensors
  (the same copy as (b), without the process crossing).

The engine's fresh tensors are page-faulted in on first touch, so on a small
machine (c) itself runs far below memory bandwidth; (b) and (c) pay that
alike, and the ratio is what the crossing costs.

Sizes are bf16 steps of 4 layers x hidden 7168. Rounds are interleaved and
medians printed, with the ratios the slot ring is held to: (b) >= 0.7x (c)
and >= 5x (a).

    python tools/benchmarks/transport.py [--sizes 64 256 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from report import recording  # noqa: E402

from speculators_v016.protocol import StepCapture
from speculators_v016.shared.slot_ring import SlotRing

LAYERS, HIDDEN, DTYPE = 4, 7168, torch.bfloat16
MiB = 2**20


def rows_for(mib: int) -> int:
    return mib * MiB // (LAYERS * HIDDEN * 2)


def worker(to_worker, to_engine, ring_spec, max_rows: int) -> None:
    """The worker: answers each request with a tensor (a) or slot metadata (b, b+)."""
    from vllm.distributed.device_communicators.shm_broadcast import (  # noqa: PLC0415 - vLLM only once a transport runs
        MessageQueue,
    )

    requests_handle = to_worker.get()
    replies = MessageQueue(1, 1)
    to_engine.put(replies.export_handle())
    requests = MessageQueue.create_from_handle(requests_handle, 0)
    requests.wait_until_ready()
    replies.wait_until_ready()
    ring = SlotRing.attach(ring_spec)
    source = torch.randn(LAYERS, max_rows, HIDDEN).to(DTYPE)  # what the runner's aux buffers hold
    while (message := requests.dequeue(indefinite=True)) is not None:
        mode, step, rows = message
        counts = [rows // 2, rows - rows // 2]
        if mode == "a":
            reply = StepCapture(step, ["r0", "r1"], [0, 0], counts, states=source[:, :rows].clone())
        else:
            if mode == "b+":
                ring.slot(step % 2)[:, :rows].copy_(source[:, :rows])
            reply = StepCapture(step, ["r0", "r1"], [0, 0], counts, slot=step % 2)
        replies.enqueue(reply)


def copy_out(states: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """The assembler's one copy: rows into fresh per-request, per-layer tensors."""
    out, offset = [], 0
    for count in counts:
        for layer in range(states.shape[0]):
            dst = torch.empty((count, states.shape[2]), dtype=states.dtype)
            dst.copy_(states[layer, offset : offset + count])
            out.append(dst)
        offset += count
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512], help="MiB per step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per measurement, two in flight")
    args = ap.parse_args()

    from vllm.distributed.device_communicators.shm_broadcast import (  # noqa: PLC0415 - vLLM only once a transport runs
        MessageQueue,
    )

    max_rows = rows_for(max(args.sizes))
    ring = SlotRing.create(slots=2, num_ids=LAYERS, max_rows=max_rows, hidden=HIDDEN, dtype=DTYPE, shared=True)
    ctx = mp.get_context("spawn")
    to_worker, to_engine = ctx.Queue(), ctx.Queue()
    requests = MessageQueue(1, 1)
    to_worker.put(requests.export_handle())
    proc = ctx.Process(target=worker, args=(to_worker, to_engine, ring.spec, max_rows), daemon=True)
    proc.start()
    replies = MessageQueue.create_from_handle(to_engine.get(timeout=300), 0)
    requests.wait_until_ready()
    replies.wait_until_ready()
    ring.unlink()  # both processes hold the mapping now
    source = torch.randn(LAYERS, max_rows, HIDDEN).to(DTYPE)

    def one(mode: str, rows: int) -> float:
        """Seconds per step over ``args.steps`` steps, two in flight."""
        start = time.perf_counter()
        if mode == "c":
            for _ in range(args.steps):
                copy_out(source[:, :rows], [rows // 2, rows - rows // 2])
            return (time.perf_counter() - start) / args.steps
        requests.enqueue((mode, 0, rows))
        for step in range(args.steps):
            if step + 1 < args.steps:
                requests.enqueue((mode, step + 1, rows))  # the next step is on its way meanwhile
            reply = replies.dequeue(indefinite=True)
            if mode == "a":  # the engine has the tensor; counted as arrived (no further copy charged)
                assert reply.states.shape[1] == rows
            else:
                copy_out(ring.slot(reply.slot)[:, :rows], reply.counts)
        return (time.perf_counter() - start) / args.steps

    modes = ["a", "b", "b+", "c"]
    seconds: dict[tuple[str, int], list[float]] = {}
    # (b), (b+) and (c) interleaved; (a) after them, since its unpickled
    # buffers change this process's heap (and so the cost of the fresh tensors).
    for phase in (["b", "c", "b+"], ["a"]):
        for mib in args.sizes:
            for mode in phase:
                one(mode, rows_for(mib))  # warm-up at this size
        for _ in range(args.rounds):
            for mib in args.sizes:
                for mode in phase:
                    seconds.setdefault((mode, mib), []).append(one(mode, rows_for(mib)))
    requests.enqueue(None)
    proc.join(timeout=30)
    ring.close()

    names = {
        "a": "(a) RPC return value",
        "b": "(b) slot ring",
        "b+": "(b+) ring + CPU worker copy",
        "c": "(c) in-process copy",
    }
    with recording(__file__):
        print(
            f"worker -> engine, GiB/s (median of {args.rounds} rounds of {args.steps} steps, 2 in flight; "
            f"bf16, {LAYERS} layers x hidden {HIDDEN}; "
            f"{torch.get_num_threads()} torch threads)"
        )
        print(f"{'step':>8} " + " ".join(f"{names[m]:>28}" for m in modes) + "   (b)/(c)  (b)/(a)")
        for mib in args.sizes:
            rate = {m: mib / 1024 / statistics.median(seconds[(m, mib)]) for m in modes}
            print(
                f"{mib:>4} MiB "
                + " ".join(f"{rate[m]:>28.2f}" for m in modes)
                + f"   {rate['b'] / rate['c']:>6.2f}x  {rate['b'] / rate['a']:>6.1f}x"
            )


if __name__ == "__main__":
    main()
