#!/usr/bin/env python3
"""Generator throughput against vLLM's LLM.generate(max_tokens=1), side by side.

Every measurement runs in its own process on the same prompts and engine
settings, interleaved over --rounds so machine noise hits all alike; the
script prints tokens/s, their ratios (medians), and (--rss) the generator's
peak RSS at N and 4N prompts (streamed, results dropped as a writer would).

Modes: ``async`` (uniprocess executor, stream()), ``generate`` (the same
through upstream's generate()), ``sync`` (async scheduling off), ``mp``
(multiprocess executor, TP=1), ``tp2`` (multiprocess, TP=2), ``pp2``
(multiprocess, pipeline parallel 2: each stage captures its own layers; sync
scheduling, the engine's choice under PP), ``pp2-async`` (the same with
``pipeline_async_scheduling``),
``llm``, ``llm-pp2`` (LLM.generate under PP 2), ``cli`` (the real command on the same prompts,
as pre-tokenized rows, writing its files to a temporary folder: its own summary's tokens/s of
generation, which has no warm-up pass and includes the last files made durable; also without those last writes,
``cli-steady``, and the CLI's CPU time of that clock). With ``pp2`` the script also
prints the ring's bytes per stage (each stage writes its layers' rows of a slot).
``--pipeline`` measures pp2 against mp and llm-pp2 (its page: pipeline_parallel.md). vLLM 0.16's own
``LLM`` at PP 2 on CPU leaves its CPU communicator's shared memory (``<port>-pp:0-[0-1]-cpushm_*``,
4 MiB each) in /dev/shm even after its engine core is shut down; our engine's shutdown leaves nothing.
``--kept`` starts each mode's engine once, makes one untimed pass, and asks it for a pass a round (the order
reversed every other round: give an even ``--rounds``), so the passes compared run seconds apart instead of an
engine start apart, all on a warm heap; the kept engines stay loaded beside each other (2 GiB of KV cache each),
while the CLI starts fresh each round: with ``--cli-prompts 256`` its mid-run rate (from half to nine tenths of the
tokens, ``cli-mid``) is past its own process's first steps. ``--shape wide`` is a wide, thin Llama (hidden 7168, 4 layers, 2 heads of 64,
MLP 64) on which moving the states weighs more than computing them.

    python tools/benchmarks/generator_vs_llm.py [--prompts 64] [--length 256] [--rounds 2] [--eager]
    python tools/benchmarks/generator_vs_llm.py --shape wide --length 512 --batched-tokens 2048 \
        --modes async mp tp2 llm
    python tools/benchmarks/generator_vs_llm.py --pipeline [--eager] [--rounds 2]
    python tools/benchmarks/generator_vs_llm.py --shape wide --length 512 --batched-tokens 2048 --eager \
        --modes async llm cli --rounds 3        # the wide CPU row: generator / LLM.generate, CLI / generator
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import bench_model, child, engine_env, pages_text, peak_rss_mib, prompts  # noqa: E402
from kept_side import Side  # noqa: E402
from report import recording  # noqa: E402

LAYERS = [2, 4, 5, 7]


SHAPES = {
    "base": dict(hidden=512, layers=8, capture=[2, 4, 5, 7]),
    # layers 1-3, as the CLI's default plan takes them: on this random, thin model the stream proof cannot
    # tell layer 0's output convention apart (one wrong candidate moves layer 1's outputs by 2.5%, under its
    # 5% margin), so a capture of layer 0 is refused: unproven, not guessed
    "wide": dict(
        hidden=7168,
        layers=4,
        capture=[1, 2, 3],
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
    ),
}
LABELS = {
    "async": "generator, async, stream()",
    "generate": "generator, async, generate()",
    "sync": "generator, sync scheduling",
    "mp": "generator, multiprocess TP=1",
    "tp2": "generator, multiprocess TP=2",
    "pp2": "generator, multiprocess PP=2",
    "pp2-async": "generator, multiprocess PP=2, async",
    "llm": "LLM.generate(max_tokens=1)",
    "llm-pp2": "LLM.generate(max_tokens=1), PP=2",
    "cli": "speculators-data-gen (files written)",
    "cli-steady": "the same, to the engine's last sample",
    "cli-mid": "the same, from half to 9/10 of the tokens",
}
PIPELINE_MODES = ["mp", "pp2", "pp2-async", "llm-pp2"]


def bind_two_workers() -> None:
    """vLLM's CPU workers of a two-worker engine bound to the cores of one NUMA node."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")


def ring_per_stage(engine) -> dict:
    """The ring's bytes, and each stage's share of a slot (the rows of its layers)."""
    spec = engine.ring.spec
    stages = {info["stage"]: info["stage_rows"] for info in engine.capture_info}
    return {
        "ring": spec.describe(),
        "stages": {
            s: [rows[1] - rows[0], spec.slot_bytes * (rows[1] - rows[0]) // spec.num_ids] for s, rows in stages.items()
        },
        "layers": spec.num_ids,
    }


def tree_usage() -> tuple[float, int]:
    """(CPU seconds: user + system, minor page faults) of this process and of its live descendants (vLLM's engine
    core process under ``LLM``, the workers of a multiprocess executor, the CLI): read before and after the timed
    pass, the difference is what the pass cost; CPU time is moved far less than the rate by another tenant."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total, faults = usage.ru_utime + usage.ru_stime, usage.ru_minflt
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    mine, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, parent in parents.items() if parent in mine} - mine
        mine |= found
        grew = bool(found)
    tick = os.sysconf("SC_CLK_TCK")
    for pid in mine - {os.getpid()}:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            faults += int(fields[7])  # minflt
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return total, faults


def cli_rate(args: dict, batch: list[list[int]]) -> dict:
    """The real command on ``batch`` (pre-tokenized rows, every token in the loss mask), this process's
    environment and code; its summary's generation rate (from its engine's first step to its last file
    made durable)."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        data.write_text("".join(json.dumps({"input_ids": p, "loss_mask": [1] * len(p)}) + "\n" for p in batch))
        cmd = [sys.executable, "-m", "speculators_v016.cli", "--target-model-path", args["model"]]
        cmd += ["--train-data-path", str(data), "--output-dir", f"{tmp}/out", "--seq-length", str(args["length"] + 7)]
        cmd += ["--dtype", "float32", "--token-freq-path", "", "--no-progress", "--num-preprocessing-workers", "1"]
        cmd += ["--layer-ids", " ".join(map(str, args["layer_ids"])), "--max-num-seqs", str(args["max_num_seqs"])]
        cmd += ["--max-num-batched-tokens", str(args["batched_tokens"])] + (
            ["--enforce-eager"] if args["eager"] else []
        )
        # cwd: `python -m` puts the working folder first on sys.path, ahead of the PYTHONPATH given
        proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(), cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"the CLI failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    tokens, seconds = re.search(r"tokens:\s+(\d+) in ([\d.]+) s of generation", proc.stdout).groups()
    if int(tokens) != len(batch) * args["length"]:
        raise RuntimeError(f"the CLI wrote {tokens} tokens of {len(batch) * args['length']}:\n{proc.stdout}")
    host = re.search(r"used ([\d.]+) CPU-s .* made durable ([\d.]+) s after the engine's last sample", proc.stdout)
    mid = re.search(r"from half to nine tenths of the tokens at ([\d,]+) tokens/s", proc.stdout)
    tokens, seconds = int(tokens), float(seconds)
    cpu, drain = (float(host[1]), float(host[2])) if host else (None, None)
    return {
        "tokens_per_s": tokens / seconds,
        # to the engine's last sample, as the generator's pass is timed: without the last files' writes
        "steady_tokens_per_s": tokens / (seconds - drain) if host else None,
        # from half to nine tenths of the tokens (speculators_v016.run.mid_run): what a long run goes at
        "mid_tokens_per_s": float(mid[1].replace(",", "")) if mid else None,
        "peak_rss_mib": None,
        "ring": None,
        "cpu_per_k": cpu / tokens * 1000 if host else None,
    }


def start(args: dict) -> tuple[Callable[[], dict], Callable[[], None]]:
    """In the child: the mode's engine started and warmed up; returns (time one pass over the prompts, shut the
    engine down). The CLI's mode starts nothing: each of its passes is the command, start to end."""
    batch = prompts(args["prompts"], args["length"])
    if args["mode"] == "cli":
        rows = prompts(args.get("cli_prompts") or args["prompts"], args["length"])
        return (lambda: cli_rate(args, rows)), (lambda: None)
    warm = prompts(4, args["length"], seed=1)
    engine = dict(
        max_model_len=args["length"] + 8,
        dtype="float32",
        enforce_eager=args["eager"],
        max_num_seqs=args["max_num_seqs"],
        max_num_batched_tokens=args["batched_tokens"],
    )
    mode = args["mode"]
    ring = None
    if mode in ("pp2", "pp2-async", "llm-pp2"):
        bind_two_workers()
    if mode in ("llm", "llm-pp2"):
        from vllm import LLM, SamplingParams  # noqa: PLC0415 - each mode's child imports what it measures

        if mode == "llm-pp2":
            engine.update(pipeline_parallel_size=2, distributed_executor_backend="mp")
        llm = LLM(model=args["model"], enable_prefix_caching=False, **engine)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        as_prompts = [{"prompt_token_ids": p} for p in batch]
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    else:
        from speculators_v016.generator import (  # noqa: PLC0415 - each mode's child imports what it measures
            VllmHiddenStatesGenerator,
        )

        if mode == "tp2":
            bind_two_workers()
        gen = VllmHiddenStatesGenerator(
            args["model"],
            layer_ids=args["layer_ids"],
            async_scheduling=mode != "sync",
            executor="mp" if mode in ("mp", "tp2", "pp2", "pp2-async") else "uni",
            tensor_parallel_size=2 if mode == "tp2" else 1,
            **engine,
            # only where used: a --before checkout older than pipeline parallelism has no such options
            **(
                dict(pipeline_parallel_size=2, pipeline_async_scheduling=mode == "pp2-async")
                if mode.startswith("pp2")
                else {}
            ),
        )
        if mode.startswith("pp2"):
            ring = ring_per_stage(gen.engine)
        gen.generate(warm)

    def one_pass() -> dict:
        (cpu, faults), began = tree_usage(), time.perf_counter()
        if mode in ("llm", "llm-pp2"):
            llm.generate(as_prompts, params, use_tqdm=False)
        elif mode == "generate":
            gen.generate(batch)
        else:
            # dropped, as a writer would after saving; a kept engine's pass is warm: its whole pass is its steady
            # rate (its samples come about four steps late and its last sixteen at once, so marks inside a pass
            # of 64 prompts would time its final burst: the CLI's mid-run marks need --cli-prompts 256)
            for _ in gen.stream(batch):
                pass
        seconds = time.perf_counter() - began
        cpu_after, faults_after = tree_usage()
        tokens = len(batch) * args["length"]
        return {"tokens_per_s": tokens / seconds, "peak_rss_mib": peak_rss_mib(), "ring": ring,
                "cpu_per_k": (cpu_after - cpu) / tokens * 1000,
                "faults_per_k": (faults_after - faults) / tokens * 1000}  # fmt: skip

    def shut_down() -> None:
        # workers killed at exit leave vLLM's CPU shared memory (PP/TP groups) in /dev/shm
        if mode in ("llm", "llm-pp2"):
            llm.llm_engine.engine_core.shutdown()
        else:
            gen.shutdown()

    return one_pass, shut_down


def measure(args: dict) -> dict:
    """In the child: start the engine, warm up, then time one pass over the prompts."""
    one_pass, shut_down = start(args)
    try:
        return one_pass()
    finally:
        shut_down()


def serve(args: dict) -> None:
    """In a kept child (``--kept``): start the engine, warm up and make one untimed pass, say so, then time one pass
    for each ``run`` line read, until stdin closes. The untimed pass grows the process's heap to what a pass needs:
    a first pass paid that growth (the first touch of fresh memory, 0.19 GB/s on a 2-core VM) in every kept run,
    the generator's first round at 0.82-0.83x of `LLM.generate`'s against 0.89-1.02x after it."""
    one_pass, shut_down = start(args)
    try:
        one_pass()
        print(json.dumps({"ready": args["mode"]}), flush=True)
        for line in sys.stdin:
            if line.strip() == "run":
                print(json.dumps(one_pass()), flush=True)
    finally:
        shut_down()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="eager engines (default: compiled)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="base")
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(set(LABELS) - {"cli-steady", "cli-mid"}),
        default=["async", "generate", "sync", "llm"],
    )
    ap.add_argument(
        "--pipeline", action="store_true", help=f"modes {' '.join(PIPELINE_MODES)}; page pipeline_parallel.md"
    )
    ap.add_argument(
        "--cli-prompts",
        type=int,
        default=None,
        help="the CLI's rows (default: --prompts): enough that its mid-run rate (from half to nine tenths of its "
        "samples) is past its process's first touch of memory; the cli and cli-steady ratios then compare runs of "
        "different sizes",
    )
    ap.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--rss", action="store_true", help="also peak RSS at N and 4N prompts")
    ap.add_argument("--kept", action="store_true", help="each mode's engine started once and kept, its passes "
                    "asked in turn (the order reversed every other round), so the passes compared run seconds "
                    "apart, not an engine start; the CLI still runs whole each round; give an even --rounds")  # fmt: skip
    ap.add_argument("--model-dir", default=None, help="default: /tmp/speculators-v016-bench/<shape>")
    ap.add_argument(
        "--before",
        default=None,
        metavar="CHECKOUT",
        help="also run each generator mode with the speculators_v016 of this checkout, interleaved",
    )
    opts = ap.parse_args()
    shape = dict(SHAPES[opts.shape])
    capture = shape.pop("capture")
    where = Path(opts.model_dir or f"/tmp/speculators-v016-bench/{opts.shape}")
    model = str(bench_model(where, shape.pop("hidden"), shape.pop("layers"), **shape))
    base = dict(
        model=model,
        length=opts.length,
        eager=opts.eager,
        max_num_seqs=opts.max_num_seqs,
        batched_tokens=opts.batched_tokens,
        layer_ids=capture,
        cli_prompts=opts.cli_prompts,
    )
    modes = PIPELINE_MODES if opts.pipeline else opts.modes
    runs = [(mode, None) for mode in modes]
    if opts.before:
        runs += [(mode, opts.before) for mode in opts.modes if mode != "llm"]
    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    faults: dict[str, list[float]] = {}  # minor page faults of the timed pass (not the CLI's: its own process)
    ring = None
    with contextlib.ExitStack() as stack:  # kept sides closed (killed if they hang) however the rounds end
        kept = {}
        for mode, code in runs if opts.kept else []:
            if mode != "cli":
                kept[mode, code] = Side(__file__, {**base, "mode": mode, "prompts": opts.prompts, "kept": True},
                                        engine_env(code))  # fmt: skip
                stack.callback(kept[mode, code].close)
        for round_no in range(opts.rounds):
            for mode, code in runs if round_no % 2 == 0 or not opts.kept else runs[::-1]:
                key = mode if code is None else f"{mode} (before)"
                side = kept.get((mode, code))
                got = side.ask() if side else child(__file__, {**base, "mode": mode, "prompts": opts.prompts}, code)
                rates.setdefault(key, []).append(got["tokens_per_s"])
                for figure, suffix in (("steady_tokens_per_s", "-steady"), ("mid_tokens_per_s", "-mid")):
                    if got.get(figure) is not None:  # each code's own figure
                        rates.setdefault(f"{mode}{suffix}" + ("" if code is None else " (before)"), []).append(
                            got[figure]
                        )
                if got.get("cpu_per_k") is not None:
                    cpu.setdefault(key, []).append(got["cpu_per_k"])
                if got.get("faults_per_k") is not None:
                    faults.setdefault(key, []).append(got["faults_per_k"])
                ring = got.get("ring") or ring
    med = {k: statistics.median(v) for k, v in rates.items()}
    shape_text = {k: v for k, v in SHAPES[opts.shape].items() if k != "capture"}
    if opts.pipeline:
        with recording(__file__, "Pipeline parallelism 2 against 1 on the CPU engine, and vLLM's own loop at PP 2",
                       page="pipeline_parallel"):  # fmt: skip
            print(
                f"{opts.shape} model ({shape_text}), {opts.prompts} prompts x {opts.length} tokens, "
                f"{'eager' if opts.eager else 'compiled'} engines, max_num_batched_tokens {opts.batched_tokens}, "
                f"layers {base['layer_ids']}, {opts.rounds} round(s) interleaved, medians"
            )
            for key in rates:
                runs_text = ", ".join(f"{r:,.0f}" for r in rates[key])
                print(f"  {LABELS[key]:39} {med[key]:10,.0f} tokens/s   (runs: {runs_text})")
            print(f"  ratio pp2 / mp (PP 2 vs PP 1, both multiprocess)  {med['pp2'] / med['mp']:.2f}x")
            print(f"  ratio pp2-async / pp2 (async scheduling under PP)  {med['pp2-async'] / med['pp2']:.2f}x")
            print(f"  ratio pp2 / llm-pp2 (ours vs vLLM's loop at PP 2)  {med['pp2'] / med['llm-pp2']:.2f}x")
            if ring is not None:
                print(f"  ring at PP 2: {ring['ring']}")
                for stage, (layers, nbytes) in sorted(ring["stages"].items()):
                    print(
                        f"    stage {stage} writes {layers} of {ring['layers']} layers: {nbytes / 2**20:,.1f} MiB a slot"
                    )
        return
    with recording(__file__):
        print(
            f"{opts.shape} model ({shape_text}), {opts.prompts} prompts x {opts.length} tokens, "
            f"{'eager' if opts.eager else 'compiled'} engines, max_num_batched_tokens {opts.batched_tokens}, "
            f"max_num_seqs {opts.max_num_seqs}, layers {base['layer_ids']}, {opts.rounds} round(s), medians; "
            + (f"the CLI: {opts.cli_prompts} prompts a pass; " if opts.cli_prompts else "")
            + f"every process: {pages_text()}"
            + (
                "; engines kept: each mode's one process made an untimed pass, then timed a pass a round, the order "
                "reversed every other round (the CLI whole each round)"
                if opts.kept
                else ""
            )
        )
        for key in rates:
            label = LABELS[key.split(" ")[0]] + (" [before]" if key.endswith("(before)") else "")
            print(f"  {label:39} {med[key]:10,.0f} tokens/s   (runs: {', '.join(f'{r:,.0f}' for r in rates[key])})")
        for key in rates:
            for ref in ("llm", "async", "async (before)"):
                if key.startswith("cli") and ref == "llm":
                    continue  # the CLI against the generator: what writing the files costs
                if key.startswith("cli") and ref.endswith("(before)") != key.endswith("(before)"):
                    continue  # each code's CLI against its own generator
                if key != ref and ref in med and key != "llm" and (ref != "async" or not key.endswith("(before)")):
                    # each round's runs side by side (one machine state): the ratio noise moves least
                    if len(rates[key]) != len(rates[ref]):  # a round without the figure (a CLI too short for it)
                        print(f"  ratio {key:>16} / {ref:<15} {med[key] / med[ref]:.2f}x of the medians (not every "
                              "round had both)")  # fmt: skip
                        continue
                    rounds = [mine / theirs for mine, theirs in zip(rates[key], rates[ref])]
                    print(
                        f"  ratio {key:>16} / {ref:<15} {med[key] / med[ref]:.2f}x of the medians; per round "
                        f"{', '.join(f'{r:.2f}' for r in rounds)}: median {statistics.median(rounds):.2f}x"
                    )
        if cpu:
            print(
                "  CPU time of the timed pass (user + system, the engine's processes included; the CLI: its own clock's),"
                " per 1,000 tokens:"
            )
            for key, values in cpu.items():
                label = LABELS[key.split(" ")[0]] + (" [before]" if key.endswith("(before)") else "")
                line = f"    {label:39} {statistics.median(values):6.3f} CPU-s (runs: {', '.join(f'{v:.3f}' for v in values)})"
                if key == "cli" and "async" in cpu:  # what the CLI's host path costs on top of the generator's pass
                    rounds = [mine - theirs for mine, theirs in zip(values, cpu["async"])]
                    line += (
                        f"; minus the generator's {statistics.median(values) - statistics.median(cpu['async']):+.3f}"
                        f", per round {', '.join(f'{r:+.3f}' for r in rounds)}: median {statistics.median(rounds):+.3f}"
                    )
                elif key != "llm" and "llm" in cpu:
                    rounds = [theirs / mine for mine, theirs in zip(values, cpu["llm"])]
                    line += (
                        f"; LLM.generate / this {statistics.median(cpu['llm']) / statistics.median(values):.2f}x, per "
                        f"round {', '.join(f'{r:.2f}' for r in rounds)}: median {statistics.median(rounds):.2f}x"
                    )
                print(line)
        if faults:
            print("  minor page faults of the timed pass (the engine's processes included), per 1,000 tokens:")
            for key, values in faults.items():
                label = LABELS[key.split(" ")[0]] + (" [before]" if key.endswith("(before)") else "")
                print(
                    f"    {label:39} {statistics.median(values):9,.0f} (runs: {', '.join(f'{v:,.0f}' for v in values)})"
                )
        if opts.rss:
            n, n4 = opts.prompts, 4 * opts.prompts
            rss = {k: child(__file__, {**base, "mode": "async", "prompts": k})["peak_rss_mib"] for k in (n, n4)}
            print(
                f"  peak RSS (generator, streamed) {rss[n]:,.0f} MiB at {n} prompts, {rss[n4]:,.0f} MiB at {n4}: "
                f"{rss[n4] / rss[n]:.2f}x"
            )


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        child_args = json.loads(sys.argv[1])
        if child_args.get("kept"):
            serve(child_args)
        else:
            print(json.dumps(measure(child_args)))
    else:
        main()
