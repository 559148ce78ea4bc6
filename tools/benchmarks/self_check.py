#!/usr/bin/env python3
"""The run's per-sample screen for states no model produces, on the main thread: this tree against another checkout's.

Every finished sample passes :func:`speculators_v016.checks.degenerate.may_be_degenerate` on the run's main
thread (the thread that also drives the engine) before it goes to the writers. On the H200 (hidden 4096, 4
layers captured, 256 prompts of 1-4k tokens) py-spy found that thread in this screen for 80% of the CLI's
generation time, 59 ms a sample, while the generator alone needs about 20 ms of GPU time for one. Alone on
a quiet machine the same screen takes a few ms: its torch CPU ops on ``[rows, 16]`` slices go through
torch's thread pool, which slows down many times over once other threads (the writers hashing, vLLM's)
take cores. Here the screen runs on samples of the run's shapes (bf16, 4 layers, rows of 1-4k tokens),
with torch's default threads as in the CLI, with and without threads hashing beside it (a writer's
load), in fresh processes that import this tree's or ``--before``'s package, interleaved over the rounds.

    python tools/benchmarks/self_check.py [--before CHECKOUT] [--hidden 4096 7168] [--busy 0 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import child  # noqa: E402
from report import recording  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 4


def busy(stop: threading.Event) -> None:
    """A writer's kind of load: hashing 16 MiB pieces (hashlib releases the GIL), until ``stop``."""
    piece = os.urandom(16 << 20)
    while not stop.is_set():
        hashlib.sha256(piece).digest()


def measure(args: dict) -> dict:
    """Child: ms per sample of the screen over ``samples`` samples of ``hidden`` (random bf16 rows), while
    ``busy`` threads hash beside it."""
    import torch  # noqa: PLC0415 - the child's own import, from the checkout on its path

    from speculators_v016.checks.degenerate import may_be_degenerate  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1024, 4097, (args["samples"],), generator=gen).tolist()
    samples = []
    for rows in lengths:
        block = torch.randn(LAYERS, rows, args["hidden"], generator=gen).to(torch.bfloat16)
        samples.append((torch.randint(0, 32000, (rows,), generator=gen), [block[j] for j in range(LAYERS)]))
    may_be_degenerate(*samples[0])  # warm
    stop = threading.Event()
    threads = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(args["busy"])]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    flagged = sum(may_be_degenerate(ids, states) for ids, states in samples)
    seconds = time.perf_counter() - start
    stop.set()
    return {"ms": seconds / len(samples) * 1e3, "flagged": flagged, "tokens": sum(lengths), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="a checkout whose speculators_v016 is measured beside this tree's")
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, os.cpu_count()],
                    help="threads hashing beside the screen (the writers' load), each in turn")  # fmt: skip
    opts = ap.parse_args()
    sides = {"this tree": str(ROOT)} | ({"before": opts.before} if opts.before else {})
    cases = [(h, b) for h in opts.hidden for b in opts.busy]
    results = {(c, s): [] for c in cases for s in sides}
    for r in range(opts.rounds):
        for hidden, load in cases:
            order = list(sides.items())
            for name, code in order if r % 2 == 0 else reversed(order):  # alternate which side goes first
                out = child(__file__, {"hidden": hidden, "samples": opts.samples, "busy": load}, code_from=code)
                assert out["flagged"] == 0, f"{name}: random states flagged"
                results[(hidden, load), name].append(out)
    with recording(__file__):
        print(f"the screen alone, bf16, {LAYERS} layers a sample, rows of 1024-4096 tokens, {opts.samples} samples "
              f"per measurement, {opts.rounds} interleaved rounds, medians, torch's default threads")  # fmt: skip
        for case in cases:
            what = f"hidden {case[0]}, {case[1]} threads hashing beside it"
            med = {s: statistics.median(o["ms"] for o in results[case, s]) for s in sides}
            for s in sides:
                tokens = statistics.median(o["tokens"] / o["seconds"] for o in results[case, s])
                rounds = ", ".join(f"{o['ms']:.2f}" for o in results[case, s])
                print(f"  {what}, {s:9s}: {med[s]:8.2f} ms a sample, {tokens:12,.0f} tokens/s "
                      f"(rounds: {rounds} ms)")  # fmt: skip
            if "before" in med:
                print(f"  {what}: before / this tree {med['before'] / med['this tree']:.1f}x")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(measure(json.loads(sys.argv[1]))))
    else:
        main()
