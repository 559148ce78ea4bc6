#!/usr/bin/env python3
"""What on-policy data buys the draft: the same EAGLE-3 training on the dataset's responses and on ``--regenerate``'s.

1. **Target**: a tiny Llama (hidden 256, 8 layers, the local tokenizer) briefly trained with
   transformers on chats in *its own language*: it answers a user line with that line's words in
   reverse order and a fixed closing phrase, so what it writes differs from the dataset's responses.
2. **Dataset**: the same user lines, each answered by two unrelated corpus lines (what another
   model or a person wrote: off-policy for this target).
3. **Data**: ``speculators-data-gen`` twice on that dataset, same engine settings (bf16, eager):
   (a) over the dataset's own responses, (b) with ``--regenerate --temperature 0`` (the target
   writes them, captured in the same pass).
4. **Draft**: upstream's ``Eagle3DraftModel`` trained by upstream's ``Trainer`` on CPU with the same
   seed, initialisation, batch size, epochs and learning rate on each folder's training split
   (every sample but each 5th); both evaluated with the trainer's own ``val_epoch`` metrics (loss,
   full_acc_k, cond_acc_k per speculative step) on the held-out 5th of (b): the target's own
   generations, what a served draft is asked to predict.

Shows: how much of the target's own continuation a draft learns from each kind of data at the
same budget, on a target whose outputs differ from the dataset by construction. Cannot show: the
size of the effect on a real target and a real dataset (their outputs overlap far more than here;
the published figures in the issue are for those), nor multi-turn effects (single-turn chats).

Phases are cached in ``--work``: ``--phase target|data|train|all``. The figures go to
docs/benchmarks/on_policy.md (report.py).

    python tools/benchmarks/on_policy.py [--conversations 160] [--epochs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from speculators_v016.run.demo import corpus_lines

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bench_model  # noqa: E402
from fp8_training import child, train_target  # noqa: E402
from report import recording  # noqa: E402

HIDDEN, LAYERS = 256, 8
CLOSING = "that is all."
KINDS = {"off": "the dataset's responses", "on": "--regenerate (the target's)"}


def lines() -> list[str]:
    return corpus_lines()


def own_language(count: int, seed: int = 1) -> list[dict]:
    """Chats the target is taught: a line, answered by its words reversed and the closing phrase."""
    rng, corpus = random.Random(seed), lines()
    out = []
    for _ in range(count):
        line = rng.choice(corpus)
        answer = " ".join(reversed(line.split())) + " " + CLOSING
        out.append({"conversations": [{"from": "human", "value": line}, {"from": "gpt", "value": answer}]})
    return out


def dataset(count: int, seed: int = 0) -> list[dict]:
    """The dataset the run gets: user lines answered by two unrelated lines (off-policy for the target)."""
    rng, corpus = random.Random(seed), lines()
    return [
        {
            "conversations": [
                {"from": "human", "value": rng.choice(corpus)},
                {"from": "gpt", "value": " ".join(rng.sample(corpus, 2))},
            ]
        }
        for _ in range(count)
    ]


def generate(model: Path, data: Path, out: Path, extra: list[str]) -> str:
    """One CLI run (bf16, eager) into ``out``; the token frequencies beside it; its summary lines."""
    if (out / "data_config.json").exists():
        return "cached"
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", "--target-model-path", str(model)]
    cmd += ["--train-data-path", str(data), "--output-dir", str(out), "--seq-length", "512"]
    cmd += ["--dtype", "bfloat16", "--enforce-eager", "--no-progress", "--num-preprocessing-workers", "1"]
    cmd += ["--token-freq-path", str(out.parent / "token_freq.pt"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    output = proc.stdout + proc.stderr
    kept = [x for x in output.splitlines() if x.startswith(("written:", "regenerated:", "logit check:", "verify:"))]
    if proc.returncode not in (0, 1) or not any(x.startswith("verify:     ok") for x in kept):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return " | ".join(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/speculators-on-policy"))
    parser.add_argument("--phase", choices=["target", "data", "train", "all"], default="all")
    parser.add_argument("--conversations", type=int, default=160)
    parser.add_argument("--target-steps", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    opts = parser.parse_args()
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in dataset(opts.conversations)))
    model = bench_model(work / "target", hidden=HIDDEN, layers=LAYERS)
    if opts.phase in ("target", "all"):
        print("target:", train_target(model, own_language(4 * opts.conversations), opts.target_steps))
    folders = {kind: work / kind / "data" for kind in KINDS}
    if opts.phase in ("data", "all"):
        regen = ["--regenerate", "--temperature", "0", "--max-new-tokens", str(opts.max_new_tokens)]
        for kind, folder in folders.items():
            folder.parent.mkdir(parents=True, exist_ok=True)
            print(f"data {kind}:", generate(model, data, folder, regen if kind == "on" else []))
    if opts.phase not in ("train", "all"):
        return
    results = {
        kind: child(
            {
                "model": str(model),
                "folder": str(folder),
                "held_out": {"the target's generations": str(folders["on"])},
                "seed": opts.seed,
                "epochs": opts.epochs,
                "batch": opts.batch,
                "lr": 3e-4,
                "max_len": 512,
                "draft_vocab": 256,
                "save": str(work / f"ckpt-{kind}"),
            }
        )
        for kind, folder in folders.items()
    }
    with recording(__file__):
        print(json.dumps(results, indent=1))
        print(
            f"\nOn-policy vs off-policy data, tiny Llama hidden {HIDDEN} x {LAYERS} layers taught its own language, "
            f"{opts.conversations} single-turn chats, draft trained {results['on']['train_steps']} steps on CPU "
            f"(same seed, batches of {opts.batch}, {opts.epochs} epochs); held out: the target's own generations\n"
        )
        print(f"{'draft trained on':<28}" + "".join(f"{KINDS[k]:>30}" for k in KINDS))
        for key in ("train_loss_first_epoch", "train_loss_last_epoch"):
            print(f"{key.replace('_', ' '):<28}" + "".join(f"{results[k][key]:>30.4f}" for k in KINDS))
        keys = ["loss"] + [f"{m}_{i}" for m in ("full_acc", "cond_acc") for i in range(3)]
        for key in keys:
            row = [results[k]["held_out"]["the target's generations"][key + "_epoch"] for k in KINDS]
            print(f"{'held-out ' + key:<28}" + "".join(f"{v:>30.4f}" for v in row))


if __name__ == "__main__":
    main()
