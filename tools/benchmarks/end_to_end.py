#!/usr/bin/env python3
"""speculators-data-gen end to end against the generator alone, on the same data, side by side.

Both run in fresh processes on the same conversations, model and engine
settings, interleaved over --rounds. "End to end" is the CLI's generation phase
(engine + NaN check + encoding + atomic writes + manifest, as its summary
reports it); "generator alone" streams the same token samples and drops them.
``--shape wide`` is a wide, thin Llama (hidden 7168, 4 layers, 2 heads of 64,
MLP 64) on which the states' bytes, not the model, set the pace.

``--steady SMALL`` also runs both on the first SMALL conversations and prints
the steady rate, (tokens of the long run - tokens of the short) / (seconds of
the long - seconds of the short), so what every run pays once (the CLI's last
files written after the engine's last step, the logit check's first samples)
cancels out, as it does over the hundreds of thousands of samples of a real run.

    python tools/benchmarks/end_to_end.py [--samples 256] [--rounds 2] [--eager] [--before CHECKOUT]
    python tools/benchmarks/end_to_end.py --shape wide --samples 128 --steady 32 --batched-tokens 2048 --eager
        [--sha256]

``--sha256`` also runs this checkout's CLI with ``--checksum sha256``, interleaved
(the hash alone, side by side). With ``--steady`` the CPU time of each process
(user + system, its children included) is compared the same way: the steady CPU
per 1,000 tokens of the CLI and of the generator, their ratio, and the CLI's extra
CPU per GiB of states written, which wall-clock noise on a shared machine moves
far less than the rates. The figures go to docs/benchmarks/end_to_end.md (report.py).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.run.demo import corpus_lines
from speculators_v016.run.prepared import prepare_samples

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import bench_model, child, engine_env  # noqa: E402
from report import recording  # noqa: E402

SEQ = 1024
SHAPES = {
    "base": dict(hidden=512, layers=8),
    "wide": dict(
        hidden=7168, layers=4, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=64
    ),
}


def children_cpu() -> float:
    """CPU seconds (user + system) of the child processes ended so far, theirs included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(run) -> dict:
    """``run()``'s result with the CPU time of the process it ran (``cpu``)."""
    before = children_cpu()
    result = run()
    return {**result, "cpu": children_cpu() - before}


def conversations(path: Path, count: int) -> Path:
    rng, lines = random.Random(0), corpus_lines()
    with path.open("w") as fh:
        for _ in range(count):
            turns = [
                {"from": "human", "value": " ".join(rng.sample(lines, 3))},
                {"from": "gpt", "value": " ".join(rng.sample(lines, 8))},
            ]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    return path


def generator_alone(args: dict) -> dict:
    samples = prepare_samples([args["data"]], AutoTokenizer.from_pretrained(args["model"]), SEQ, num_proc=1)
    gen = VllmHiddenStatesGenerator(
        args["model"],
        max_model_len=SEQ + 1,
        dtype="float32",
        enforce_eager=args["eager"],
        max_num_batched_tokens=args["batched_tokens"],
    )
    gen.generate(samples.input_ids[:4])
    start = time.perf_counter()
    for _ in gen.stream(samples.input_ids):
        pass
    seconds = time.perf_counter() - start
    tokens = sum(map(len, samples.input_ids))
    return {
        "samples_per_s": len(samples) / seconds,
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "samples": len(samples),
    }


def end_to_end(
    model: str, data: Path, eager: bool, batched_tokens: int | None, code_from: str | None = None, extra: tuple = ()
) -> dict:
    """The CLI's generation phase, as its summary reports it (``code_from``: another checkout's code;
    ``extra``: more CLI arguments)."""
    with tempfile.TemporaryDirectory() as tmp:
        # speculators_v016.cli (not .run.cli): the path older checkouts (--before) have too
        cmd = [
            sys.executable,
            "-m",
            "speculators_v016.cli",
            "--target-model-path",
            model,
            "--train-data-path",
            str(data),
            "--output-dir",
            f"{tmp}/out",
            "--seq-length",
            str(SEQ),
            "--dtype",
            "float32",
            "--token-freq-path",
            "",
            "--no-progress",
            "--num-preprocessing-workers",
            "1",
        ]
        cmd += ["--enforce-eager"] if eager else []
        cmd += ["--max-num-batched-tokens", str(batched_tokens)] if batched_tokens else []
        cmd += list(extra)
        # cwd: `python -m` puts the working folder first on sys.path, ahead of code_from's PYTHONPATH
        proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(code_from), cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
    written = int(re.search(r"written:\s+(\d+) samples", proc.stdout).group(1))
    tokens, seconds = re.search(r"tokens:\s+(\d+) in ([\d.]+) s of generation", proc.stdout).groups()
    on_disk = int(re.search(r"bytes:\s+([\d,]+)", proc.stdout).group(1).replace(",", ""))
    return {
        "samples_per_s": written / float(seconds),
        "tokens_per_s": int(tokens) / float(seconds),
        "tokens": int(tokens),
        "seconds": float(seconds),
        "samples": written,
        "bytes": on_disk,
    }


def steady(long: dict, short: dict) -> dict:
    """The rate between a short and a long run of the same first prompts: what both pay once cancels
    (the process's start, its engine's, a compile), in wall time and in CPU time."""
    seconds, tokens = long["seconds"] - short["seconds"], long["tokens"] - short["tokens"]
    out = {"samples_per_s": (long["samples"] - short["samples"]) / seconds, "tokens_per_s": tokens / seconds}
    out["cpu"] = long["cpu"] - short["cpu"]
    out["cpu_per_k_tokens"] = out["cpu"] / tokens * 1000
    if "bytes" in long:
        out["bytes"] = long["bytes"] - short["bytes"]
    return out


def cpu_lines(runs: dict, kinds: list[str]) -> list[str]:
    """Steady CPU per 1,000 tokens of each kind against the generator's (beside it, per round), and the extra
    CPU per GiB written: (this run's steady CPU - the generator's) / its steady bytes."""
    gen = runs["steady gen"]
    out = ["  steady CPU time (user + system, children included; per 1,000 tokens, medians):"]
    out.append(
        f"    {'generator alone (dropped)':32} {statistics.median(r['cpu_per_k_tokens'] for r in gen):6.3f} CPU-s"
    )
    for kind in kinds:
        mine = runs[f"steady {kind}"]
        ratio = [g["cpu_per_k_tokens"] / m["cpu_per_k_tokens"] for g, m in zip(gen, mine)]
        extra = [(m["cpu"] - g["cpu"]) / (m["bytes"] / 2**30) for g, m in zip(gen, mine)]
        label = {"cli": "speculators-data-gen", "sha256": "  --checksum sha256", "before": "  before"}[kind]
        out.append(
            f"    {label:32} {statistics.median(r['cpu_per_k_tokens'] for r in mine):6.3f} CPU-s; "
            f"generator / this {statistics.median(ratio):.2f}x (per round {', '.join(f'{x:.2f}' for x in ratio)}); "
            f"{statistics.median(extra):.2f} CPU-s more per GiB written"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="base")
    ap.add_argument("--batched-tokens", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    ap.add_argument(
        "--steady",
        type=int,
        default=None,
        metavar="SMALL",
        help="also run on the first SMALL conversations and print the steady rate (long - short)",
    )
    ap.add_argument("--model-dir", default=None, help="default: /tmp/speculators-v016-bench/<shape>")
    ap.add_argument(
        "--before",
        default=None,
        metavar="CHECKOUT",
        help="also run the CLI with the speculators_v016 of this checkout, interleaved",
    )
    ap.add_argument(
        "--sha256", action="store_true", help="also this checkout's CLI with --checksum sha256, interleaved"
    )
    opts = ap.parse_args()
    shape = dict(SHAPES[opts.shape])
    where = Path(opts.model_dir or f"/tmp/speculators-v016-bench/{opts.shape}")
    model = str(bench_model(where, shape.pop("hidden"), shape.pop("layers"), **shape))
    with tempfile.TemporaryDirectory() as tmp:
        data = conversations(Path(tmp) / "chats.jsonl", opts.samples)
        lengths = {"": data}
        if opts.steady:
            lengths["short "] = Path(tmp) / "short.jsonl"
            lengths["short "].write_text("".join(data.read_text().splitlines(keepends=True)[: opts.steady]))
        kinds = ["cli", "gen"] + (["sha256"] if opts.sha256 else []) + (["before"] if opts.before else [])
        runs = {f"{n}{k}": [] for n in lengths for k in kinds}
        gen_args = {"model": model, "eager": opts.eager, "batched_tokens": opts.batched_tokens}
        for _ in range(opts.rounds):
            for name, path in lengths.items():
                runs[f"{name}cli"].append(
                    measured(lambda p=path: end_to_end(model, p, opts.eager, opts.batched_tokens))
                )
                if opts.sha256:
                    extra = ("--checksum", "sha256")
                    runs[f"{name}sha256"].append(
                        measured(lambda p=path, x=extra: end_to_end(model, p, opts.eager, opts.batched_tokens, None, x))
                    )
                if opts.before:
                    runs[f"{name}before"].append(
                        measured(lambda p=path: end_to_end(model, p, opts.eager, opts.batched_tokens, opts.before))
                    )
                runs[f"{name}gen"].append(measured(lambda p=path: child(__file__, gen_args | {"data": str(p)})))
        if opts.steady:
            for key in [k for k in runs if not k.startswith("short ")]:
                runs[f"steady {key}"] = [steady(a, b) for a, b in zip(runs[key], runs[f"short {key}"])]
    out: list[str] = []
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("samples_per_s", "tokens_per_s")} for k, v in runs.items()
    }
    out.append(
        f"{opts.shape} model ({SHAPES[opts.shape]}), {opts.samples} conversations, seq length {SEQ}, "
        f"{'eager' if opts.eager else 'compiled'}, max_num_batched_tokens {opts.batched_tokens or 'default'}, "
        f"{opts.rounds} round(s), medians"
    )
    for key, values in runs.items():
        rates = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in values)
        out.append(f"  runs {key}: {rates} tokens/s")
    for prefix, what in (
        ("", f"{opts.samples} conversations"),
        ("short ", f"the first {opts.steady}"),
        ("steady ", f"steady: {opts.samples} minus the first {opts.steady}"),
    ):
        if f"{prefix}cli" not in med:
            continue
        out.append(f"  {what}:")
        for key, label in (
            ("cli", "speculators-data-gen (written)"),
            ("sha256", "  the same, --checksum sha256"),
            ("before", "  the same, before"),
            ("gen", "generator alone (dropped)"),
        ):
            if f"{prefix}{key}" in med:
                out.append(
                    f"    {label:32} {med[prefix + key]['samples_per_s']:8.1f} samples/s "
                    f"{med[prefix + key]['tokens_per_s']:10,.0f} tokens/s"
                )
        out.append(
            f"    ratio end-to-end / generator   "
            f"{med[prefix + 'cli']['tokens_per_s'] / med[prefix + 'gen']['tokens_per_s']:.2f}x"
        )
        per_round = [c["tokens_per_s"] / g["tokens_per_s"] for c, g in zip(runs[prefix + "cli"], runs[prefix + "gen"])]
        out.append(
            f"    per round (each CLI run / the generator run beside it): {', '.join(f'{r:.2f}' for r in per_round)}"
            f"; median {statistics.median(per_round):.2f}x"
        )
        if f"{prefix}sha256" in med:
            out.append(
                f"    ratio sha256 end-to-end / generator "
                f"{med[prefix + 'sha256']['tokens_per_s'] / med[prefix + 'gen']['tokens_per_s']:.2f}x"
            )
        if f"{prefix}before" in med:
            out.append(
                f"    ratio end-to-end after / before "
                f"{med[prefix + 'cli']['tokens_per_s'] / med[prefix + 'before']['tokens_per_s']:.2f}x"
            )
    if opts.steady:
        out += cpu_lines(runs, [k for k in kinds if k != "gen"])
    with recording(__file__):
        print("\n".join(out))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(generator_alone(json.loads(sys.argv[1]))))
    else:
        main()
