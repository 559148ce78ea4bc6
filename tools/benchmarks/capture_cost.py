#!/usr/bin/env python3
"""What the capture's own work costs a CPU step of the wide row, op by op, with huge pages and without.

On a CPU engine the capture adds work to each step that `LLM.generate` does not do: vLLM's aux-state adds
(``hidden_states + residual``, a new ``[tokens, hidden]`` tensor for each captured layer before the last), the
final norm's tap (the same add at the last layer's output) and the copy of every row into its prompt's own
tensors (a sample outlives the step). On the wide row's model (hidden 7168, MLP 64, two heads) a step is
mostly such whole-width passes over memory, so this work weighs far more than on a real model.

Timed here at the wide row's settings, in one process per page kind (glibc asked for transparent huge
pages, as the command and the benchmarks' engines are, then not), interleaved over --rounds, medians of
--reps calls each: one aux add, the copies of one layer's step rows into --length-row tensors (made fresh, as
the generator's samples are, and the CLI's on a CPU engine too while a layer is under glibc's mmap ceiling; and
kept ones, as a pool's reused blocks are, and as the generator's fresh samples are in the command's kept heap,
which reuses freed memory: the child processes here run without it), and
vLLM's own RMSNorm with its residual add (`RMSNorm.forward_static`, the op a Llama layer runs twice) as
the unit of the forward's own work. Then the capture's ms per step (--aux adds, one tap, --aux + 1 layers
copied), and, given --step-tokens-per-s (the generator's rate in the wide row), its share of a step (huge pages: the engines' setting).

    python tools/benchmarks/capture_cost.py [--step-tokens-per-s 1600] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import recording  # noqa: E402

from speculators_v016.run import huge_pages  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls of ``fn`` (after one untimed call)."""
    fn()
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def measure(args: dict) -> dict:
    """In the child: the three ops at the given shape, in this process's pages."""
    import torch  # noqa: PLC0415 - the child only
    from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: PLC0415 - the child only

    tokens, hidden, length = args["tokens"], args["hidden"], args["length"]
    hidden_states, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    weight = torch.ones(hidden)
    aux = hidden_states + residual
    samples = [torch.empty(length, hidden) for _ in range(tokens // length)]

    def copy_rows() -> None:
        for i, sample in enumerate(samples):
            sample.copy_(aux[i * length : (i + 1) * length])

    def copy_rows_fresh() -> None:  # the assembler's way with fresh tensors (the generator's samples): made, copied
        made = [torch.empty(length, hidden) for _ in range(tokens // length)]
        for i, sample in enumerate(made):
            sample.copy_(aux[i * length : (i + 1) * length])
        del made  # the caller drops each sample once it has it (the benchmark's stream; a writer once on disk)

    reps = args["reps"]
    return {
        "add": timed(lambda: hidden_states + residual, reps),
        "copy": timed(copy_rows, reps),
        "fresh": timed(copy_rows_fresh, reps),
        "norm": timed(
            lambda: RMSNorm.forward_static(hidden_states, 1e-6, hidden, torch.float32, weight, residual), reps
        ),
        "threads": torch.get_num_threads(),
    }


def child(args: dict, huge: bool) -> dict:
    """The ops timed in a child whose glibc was asked for huge pages as the command asks for them, or not (its heap
    as glibc keeps it by itself either way, so fresh tensors are faulted in: what they cost without the command's
    kept heap; with it, the generator's fresh samples reuse freed memory, which the copies into kept tensors time)."""
    env = {**os.environ, huge_pages.OPT_OUT: "1" if huge else "0"}
    ours = {huge_pages.TUNABLE, *huge_pages.HEAP}
    users = {k: v for k, v in huge_pages.given(env.pop("GLIBC_TUNABLES", "")).items() if k not in ours}
    if huge and huge_pages.TUNABLE not in huge_pages.given(huge_pages.wanted(env) or ""):
        raise SystemExit(
            "this host's glibc or transparent huge pages setting gives no huge pages (docs/commands/run.md)"
        )
    tunables = {**users, **({huge_pages.TUNABLE: "1"} if huge else {})}  # the user's other tunables kept
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(f"{k}={v}" for k, v in tunables.items())
    proc = subprocess.run([sys.executable, __file__, json.dumps(args)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{__file__} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a step (the wide row's max_num_batched_tokens)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--length", type=int, default=512, help="a prompt's tokens (rows a sample tensor holds)")
    ap.add_argument("--aux", type=int, default=3, help="captured layers before the last (vLLM's aux adds)")
    ap.add_argument("--step-tokens-per-s", type=float, help="the generator's rate: the capture's share of a step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    opts = ap.parse_args()
    args = dict(tokens=opts.tokens, hidden=opts.hidden, length=opts.length, reps=opts.reps)
    got: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(opts.rounds):
        for huge in (True, False):
            got[huge].append(child(args, huge))
    step_ms = opts.tokens / opts.step_tokens_per_s * 1e3 if opts.step_tokens_per_s else None
    with recording(__file__):
        print(
            f"float32 [{opts.tokens}, {opts.hidden}] (a wide-row step), samples of {opts.length} rows, "
            f"{got[True][0]['threads']} torch threads, {opts.rounds} interleaved rounds of {opts.reps} calls, "
            f"medians; capture per step = {opts.aux + 1} adds ({opts.aux} aux, the final norm's tap) + "
            f"{opts.aux + 1} layers' row copies"
        )
        for huge in (True, False):
            med = {k: statistics.median(r[k] for r in got[huge]) for k in ("add", "copy", "fresh", "norm")}
            capture = (opts.aux + 1) * (med["add"] + med["fresh"])
            kept = (opts.aux + 1) * (med["add"] + med["copy"])
            line = (
                f"  {'huge pages' if huge else '4 KiB pages'}: an add {med['add']:.1f} ms, a layer's row copies "
                f"{med['fresh']:.1f} ms into fresh tensors ({med['copy']:.1f} into kept ones), vLLM's RMSNorm with "
                f"its residual {med['norm']:.1f} ms; capture {capture:.0f} ms a step into fresh tensors faulted in "
                f"(glibc's own heap), {kept:.0f} ms into memory already faulted in (the command's kept heap, in which "
                f"the generator's fresh samples reuse freed memory) = {capture / med['norm']:.2f}, "
                f"{kept / med['norm']:.2f} RMSNorms"
            )
            if step_ms and huge:  # the rate given is the engines' own, measured with huge pages
                line += (
                    f"; {capture / step_ms:.1%}, {kept / step_ms:.1%} of a {step_ms:,.0f} ms step at "
                    f"{opts.step_tokens_per_s:,.0f} tokens/s"
                )
            print(line)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(measure(json.loads(sys.argv[1]))))
    else:
        main()
