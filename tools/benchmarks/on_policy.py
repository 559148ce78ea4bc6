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
the published figures in the issue are for those).

``--multi-turn`` measures instead (its own run, its own page: docs/benchmarks/on_policy_multi_turn.md)
what folding a conversation's regenerated turns into one sample buys (``--regenerate-samples auto``)
against one sample per turn (``turn``):

5. **Target**: another tiny Llama of the same size taught the same language in conversations of 1
   to 6 exchanges (regenerate.py's ``taught_chats``), so that its turns fold.
6. **Data**: prompt-only conversations of 3 to 6 user turns (regenerate.py's
   ``multi_turn_conversations``); ``--regenerate --temperature 0`` with ``turn`` (T) and with
   ``auto`` (M) on the same training conversations (greedy: the same generated tokens), and ``auto``
   on other, held-out conversations (never in either training set; the 45 corpus lines recur).
7. **Draft**: the same draft and trainer; every step packs whole samples (seeded shuffle, none cut)
   into one sequence of ``--mt-max-len`` positions (padded), so a step costs the same in both. Held
   equal between T and M: seed, initialisation, vocabulary mapping (M's token counts), learning
   rate, positions per step and the number of steps (M's ``--mt-epochs`` epochs): the same compute.
   T's samples repeat each turn's history, so at the same steps T sees fewer supervised (generated)
   tokens; ``--mt-same-epochs`` adds a row training T for ``--mt-epochs`` full epochs (the same
   supervised tokens as M, more steps and compute). All evaluated with ``val_epoch`` on the held-out conversations (packed the same way).

Cannot show for multi-turn: a real model's fraction of folded turns (a taught target folds far more
readily; see docs/regenerate.md), nor anything about long contexts (these are a few hundred tokens).

Phases are cached in ``--work``: ``--phase target|data|train|all``. The figures go to
docs/benchmarks/on_policy.md, with ``--multi-turn`` to docs/benchmarks/on_policy_multi_turn.md (report.py).

    python tools/benchmarks/on_policy.py [--conversations 160] [--epochs 4]
    python tools/benchmarks/on_policy.py --multi-turn [--mt-conversations 32] [--mt-epochs 5] [--mt-max-len 1024]
        [--mt-same-epochs]
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
from regenerate import multi_turn_conversations, taught_chats  # noqa: E402
from report import recording  # noqa: E402

from speculators_v016.store.manifest import Manifest  # noqa: E402
from speculators_v016.store.sample_format import load_sample  # noqa: E402

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


def generate(model: Path, data: Path, out: Path, extra: list[str], seq: int = 512) -> str:
    """One CLI run (bf16, eager) into ``out``; the token frequencies beside it; its summary lines."""
    if (out / "data_config.json").exists():
        return "cached"
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", "--target-model-path", str(model)]
    cmd += ["--train-data-path", str(data), "--output-dir", str(out), "--seq-length", str(seq)]
    cmd += ["--dtype", "bfloat16", "--enforce-eager", "--no-progress", "--num-preprocessing-workers", "1"]
    cmd += ["--token-freq-path", str(out.parent / "token_freq.pt"), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    output = proc.stdout + proc.stderr
    kept = [x for x in output.splitlines() if x.startswith(("written:", "regenerated:", "logit check:", "verify:"))]
    if proc.returncode not in (0, 1) or not any(x.startswith("verify:     ok") for x in kept):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return " | ".join(kept)


MT_KINDS = {
    "T": "turn, same steps",
    "M": "auto, same steps",
    "T*": "turn, same epochs",
}


def folder_samples(folder: Path) -> list[dict]:
    """Every sample of a folder, in index order: its file, its length, its supervised (loss-masked) tokens."""
    out = []
    for _, entry in sorted(Manifest(folder).entries().items()):
        sample = load_sample(folder / entry.file)
        out.append(
            {"file": str(folder / entry.file), "tokens": entry.tokens, "supervised": int(sample["loss_mask"].sum())}
        )
    return out


def packed(lengths: list[int], max_len: int, seed: int, steps: int | None = None, epochs: int = 1) -> list[list[int]]:
    """Batches of whole samples, each at most ``max_len`` tokens: passes in a seeded shuffled order (none for
    ``seed < 0``), until ``steps`` batches (if given) or else ``epochs`` passes."""
    if max(lengths) > max_len:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit --mt-max-len {max_len}")
    rng, batches, passes = random.Random(seed), [], 0
    while True:
        order = list(range(len(lengths)))
        if seed >= 0:
            rng.shuffle(order)
        batch, used = [], 0
        for i in order:
            if batch and used + lengths[i] > max_len:
                batches.append(batch)
                batch, used = [], 0
            batch.append(i)
            used += lengths[i]
        batches.append(batch)
        passes += 1
        if steps is not None and len(batches) >= steps:
            return batches[:steps]
        if steps is None and passes == epochs:
            return batches


def multi_turn(opts, work: Path) -> dict:
    """Target, data and drafts of the multi-turn rows (cached in ``work / "mt"``); their figures."""
    work = work / "mt"
    work.mkdir(parents=True, exist_ok=True)
    model = bench_model(work / "target", hidden=HIDDEN, layers=LAYERS)
    if opts.phase in ("target", "all"):
        print("multi-turn target:", train_target(model, taught_chats(4 * opts.mt_conversations), opts.target_steps))
    train_data = multi_turn_conversations(work / "chats.jsonl", opts.mt_conversations, seed=0)
    held_data = multi_turn_conversations(work / "held.jsonl", max(4, opts.mt_conversations // 4), seed=1)
    folders = {"T": work / "turn" / "data", "M": work / "auto" / "data", "held": work / "held" / "data"}
    if opts.phase in ("data", "all"):
        regen = ["--regenerate", "--temperature", "0", "--max-new-tokens", str(opts.max_new_tokens)]
        for key, data, mode in (("T", train_data, "turn"), ("M", train_data, "auto"), ("held", held_data, "auto")):
            folders[key].parent.mkdir(parents=True, exist_ok=True)
            run = generate(model, data, folders[key], [*regen, "--regenerate-samples", mode], seq=opts.mt_max_len)
            print(f"multi-turn data {key} ({mode}):", run)
    if opts.phase not in ("train", "all"):
        return {}
    samples = {key: folder_samples(folder) for key, folder in folders.items()}
    held = samples["held"]
    held_batches = packed([x["tokens"] for x in held], opts.mt_max_len, seed=-1)
    m_batches = packed([x["tokens"] for x in samples["M"]], opts.mt_max_len, opts.seed, epochs=opts.mt_epochs)
    plans = {
        "M": ("M", m_batches),
        "T": ("T", packed([x["tokens"] for x in samples["T"]], opts.mt_max_len, opts.seed, steps=len(m_batches))),
        "T*": ("T", packed([x["tokens"] for x in samples["T"]], opts.mt_max_len, opts.seed, epochs=opts.mt_epochs)),
    }
    results = {}
    for name in kinds(opts):
        source, batches = plans[name]
        files = [x["file"] for x in samples[source]]
        result = child(
            {
                "model": str(model),
                "folder": str(folders[source]),
                "freq": str(folders["M"].parent / "token_freq.pt"),
                "train_batches": {"files": files, "batches": batches},
                "held_out": {"held-out conversations": {"files": [x["file"] for x in held], "batches": held_batches}},
                "seed": opts.seed,
                "epochs": 1,
                "batch": 0,
                "lr": 3e-4,
                "max_len": opts.mt_max_len,
                "draft_vocab": 256,
                "save": str(work / f"ckpt-{name}"),
            }
        )
        result["supervised_seen"] = sum(samples[source][i]["supervised"] for b in batches for i in b)
        result["tokens_seen"] = sum(samples[source][i]["tokens"] for b in batches for i in b)
        results[name] = result
    stats = {
        key: {
            "samples": len(rows),
            "tokens_stored": sum(x["tokens"] for x in rows),
            "supervised": sum(x["supervised"] for x in rows),
        }
        for key, rows in samples.items()
    }
    return {"data": stats, "training": results, "held_batches": len(held_batches)}


def kinds(opts) -> list[str]:
    return [k for k in MT_KINDS if k != "T*" or opts.mt_same_epochs]


def print_multi_turn(opts, mt: dict) -> None:
    data, res = mt["data"], mt["training"]
    held = data["held"]
    print(
        f"Multi-turn: tiny Llama hidden {HIDDEN} x {LAYERS} layers taught the language in conversations of 1 to 6 "
        f"exchanges; {opts.mt_conversations} prompt-only training conversations of 3 to 6 user turns regenerated "
        f"(greedy, up to {opts.max_new_tokens} new tokens) with --regenerate-samples turn (T) and auto (M); held out: "
        f"{max(4, opts.mt_conversations // 4)} other conversations regenerated by the target ({held['samples']} "
        f"samples, {held['supervised']:,} generated tokens, {mt['held_batches']} packed batches). Every step: whole "
        f"samples packed into {opts.mt_max_len} positions; same seed, init, vocab mapping, lr\n"
    )
    print(f"{'':30}{'samples':>10}{'tokens stored':>15}{'supervised':>12}")
    for key, label in (("T", "T: --regenerate-samples turn"), ("M", "M: --regenerate-samples auto")):
        d = data[key]
        print(f"{label:30}{d['samples']:>10,}{d['tokens_stored']:>15,}{d['supervised']:>12,}")
    print()
    print(f"{'draft trained on':<30}" + "".join(f"{MT_KINDS[k]:>20}" for k in kinds(opts)))
    print(f"{'steps':<30}" + "".join(f"{res[k]['train_steps']:>20,}" for k in kinds(opts)))
    print(
        f"{'positions (steps x max len)':<30}"
        + "".join(f"{res[k]['train_steps'] * opts.mt_max_len:>20,}" for k in kinds(opts))
    )
    print(f"{'sample tokens seen':<30}" + "".join(f"{res[k]['tokens_seen']:>20,}" for k in kinds(opts)))
    print(f"{'supervised tokens seen':<30}" + "".join(f"{res[k]['supervised_seen']:>20,}" for k in kinds(opts)))
    for key in ("train_loss_first_tenth", "train_loss_last_tenth"):
        print(f"{key.replace('_', ' '):<30}" + "".join(f"{res[k][key]:>20.4f}" for k in kinds(opts)))
    keys = ["loss"] + [f"{m}_{i}" for m in ("full_acc", "cond_acc") for i in range(3)]
    for key in keys:
        row = [res[k]["held_out"]["held-out conversations"][key + "_epoch"] for k in kinds(opts)]
        print(f"{'held-out ' + key:<30}" + "".join(f"{v:>20.4f}" for v in row))


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
    parser.add_argument("--multi-turn", action="store_true", help="the multi-turn rows (turn vs auto) instead")
    parser.add_argument("--mt-conversations", type=int, default=32, help="multi-turn training conversations")
    parser.add_argument("--mt-epochs", type=int, default=5, help="multi-turn: epochs of M (its steps: everyone's)")
    parser.add_argument("--mt-same-epochs", action="store_true", help="multi-turn: also T for --mt-epochs epochs")
    parser.add_argument("--mt-max-len", type=int, default=1024, help="multi-turn: positions per packed step")
    opts = parser.parse_args()
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    if opts.multi_turn:
        mt = multi_turn(opts, work)
        if mt:
            summary = "What folding multi-turn regenerated conversations buys the draft: `auto` vs `turn` samples."
            with recording(__file__, summary, page="on_policy_multi_turn"):
                print(json.dumps(mt, indent=1))
                print_multi_turn(opts, mt)
        return
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
