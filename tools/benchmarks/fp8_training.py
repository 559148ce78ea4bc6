"""What FP8 storage costs the draft: the same data in bf16 and in FP8, the same EAGLE-3 training on each.

1. **Target**: a tiny Llama (hidden 256, 8 layers, the local tokenizer), briefly
   trained with transformers on conversations built from the demo corpus, so its
   next-token distribution (what the draft learns) is sharp, not uniform.
2. **Data**: ``speculators-data-gen`` runs twice on the same conversations, bf16
   engine, storing bf16 (``--hidden-states-dtype auto``) and FP8 (``fp8_e4m3``).
   Reconstruction error of the FP8 states against the bf16 run: per element
   relative to its row's amax, and per row ``||deq - x|| / ||x||`` (median, max).
3. **Draft**: upstream's ``Eagle3DraftModel`` trained with upstream's ``Trainer``
   on CPU (eager), identical seed, initialisation, batches and steps on both
   folders; the same held-out samples (every 5th) evaluated with the trainer's own
   ``val_epoch`` metrics (loss, full_acc_k, cond_acc_k per speculative step): both
   drafts on the bf16 held-out states (what a served draft sees), and the FP8 draft
   on its own FP8 held-out states.

Side by side at the end. Phases are cached in ``--work`` (target, data, training),
so each can be re-run alone: ``--phase target|data|train|all``. The data phase
starts vLLM: run it under the engine lock.

    flock /tmp/vllm-engine.lock python tools/benchmarks/fp8_training.py --phase data
    python tools/benchmarks/fp8_training.py --phase train
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from speculators_v016.run.demo import corpus_lines
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bench_model  # noqa: E402
from report import recording  # noqa: E402

HIDDEN, LAYERS = 256, 8
STORAGES = ("auto", "fp8_e4m3")


def conversations(count: int, seed: int = 0) -> list[dict]:
    rng, lines = random.Random(seed), corpus_lines()
    return [
        {
            "conversations": [
                {"from": "human", "value": rng.choice(lines)},
                {"from": "gpt", "value": " ".join(rng.sample(lines, 2))},
            ]
        }
        for _ in range(count)
    ]


def train_target(model: Path, chats: list[dict], steps: int) -> dict:
    """Teach the random target the corpus (next-token loss on whole chats) with transformers, in place."""
    marker = model / "briefly-trained.json"
    if marker.exists():
        return json.loads(marker.read_text())
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    texts = [
        tok.apply_chat_template(
            [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                for t in c["conversations"]
            ],
            tokenize=False,
        )
        for c in chats
    ]
    stream = torch.tensor([i for t in texts for i in tok(t)["input_ids"]])
    opt = torch.optim.AdamW(lm.parameters(), lr=2e-3)
    length, batch, losses = 128, 8, []
    lm.train()
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - length - 1, (batch,))
        ids = torch.stack([stream[s : s + length] for s in starts])
        loss = lm(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    lm.save_pretrained(model)
    info = {"steps": steps, "first_loss": losses[0], "last_loss": statistics.mean(losses[-10:]), "tokens": len(stream)}
    marker.write_text(json.dumps(info))
    return info


def generate(model: Path, data: Path, out: Path, storage: str) -> None:
    if (out / "data_config.json").exists():
        return
    cmd = [
        sys.executable,
        "-m",
        "speculators_v016.run.cli",
        "--target-model-path",
        str(model),
        "--train-data-path",
        str(data),
        "--output-dir",
        str(out),
        "--seq-length",
        "512",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--no-progress",
        "--token-freq-path",
        str(out.parent / "token_freq.pt"),
        "--hidden-states-dtype",
        storage,
        "--num-preprocessing-workers",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.startswith(("logit check:", "verify:"))]
    # exit 1 with the folder verified: only the logit check failed (its verdict is printed, the data is used)
    if proc.returncode not in (0, 1) or not any(line.startswith("verify:     ok") for line in lines):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    print(f"{storage}: " + " | ".join(lines))


def split(folder: Path) -> tuple[list[str], list[str]]:
    entries = sorted(Manifest(folder).entries().items())
    held = [str(folder / e.file) for i, e in entries if i % 5 == 4]
    return [str(folder / e.file) for i, e in entries if i % 5 != 4], held


def reconstruction(work: Path) -> dict:
    """FP8 against bf16 of the same conversations: relative to row amax per element, and per row L2."""
    ref_dir, fp8_dir = work / "data-auto", work / "data-fp8_e4m3"
    per_element, per_row, amax_max, tokens = [], [], 0.0, 0
    for index, entry in sorted(Manifest(ref_dir).entries().items()):
        ref = load_sample(ref_dir / entry.file)
        got = load_sample(fp8_dir / Manifest(fp8_dir).entries()[index].file)
        tokens += len(ref["input_ids"])
        for x, y in zip(ref["hidden_states"], got["hidden_states"]):
            x = x.float()
            amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            rel = (y - x).abs() / amax
            per_element.append(rel.flatten()[::97])  # a sample of the elements for the median
            amax_max = max(amax_max, rel.max().item())
            per_row += ((y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)).tolist()
    sample = torch.cat(per_element)
    fp8_bytes = sum(e.bytes for e in Manifest(fp8_dir).entries().values())
    ref_bytes = sum(e.bytes for e in Manifest(ref_dir).entries().values())
    return {
        "element_median": sample.median().item(),
        "element_max": amax_max,
        "row_median": statistics.median(per_row),
        "row_max": max(per_row),
        "tokens": tokens,
        "bytes_per_token": {"auto": ref_bytes / tokens, "fp8_e4m3": fp8_bytes / tokens},
    }


def train_draft(args: dict) -> dict:
    """(child) Train the draft on one folder; evaluate on held-out sets; return the trainer's metrics."""
    from speculators import (  # noqa: PLC0415 - upstream's trainer: the training child only
        SpeculatorsConfig,
        VerifierConfig,
    )
    from speculators.models.eagle3 import (  # noqa: PLC0415 - upstream's trainer: the training child only
        Eagle3DraftModel,
        Eagle3SpeculatorConfig,
    )
    from speculators.proposals.greedy import (  # noqa: PLC0415 - upstream's trainer: the training child only
        GreedyTokenProposalConfig,
    )
    from speculators.train.data import (  # noqa: PLC0415 - upstream's trainer: the training child only
        Eagle3SampleFileDataset,
        create_collate_fn,
    )
    from speculators.train.trainer import (  # noqa: PLC0415 - upstream's trainer: the training child only
        Trainer,
        TrainerConfig,
    )
    from speculators.train.vocab_mapping import (  # noqa: PLC0415 - upstream's trainer: the training child only
        build_vocab_mappings_from_distribution,
    )

    metrics: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict):
                metrics.append(record.msg)

    logging.getLogger("speculators.metrics").addHandler(Keep())
    logging.getLogger("speculators.metrics").setLevel(logging.INFO)
    model_dir, folder = args["model"], Path(args["folder"])
    target = AutoConfig.from_pretrained(model_dir)
    layers = json.loads((folder / "data_config.json").read_text())["speculators_v016"]["layers"]
    freq = torch.load(args.get("freq") or folder.parent / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, args["draft_vocab"], target.vocab_size)
    torch.manual_seed(args["seed"])
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(
            hidden_size=target.hidden_size,
            intermediate_size=2 * target.hidden_size,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=1,
            vocab_size=target.vocab_size,
            attn_implementation="simple_flex_attention",
        ),
        draft_vocab_size=args["draft_vocab"],
        eagle_aux_hidden_state_layer_ids=layers["eagle_aux_hidden_state_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=model_dir, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
    max_len = args["max_len"]
    if "train_batches" in args:  # packed: {"files": [...], "batches": [[index, ...], ...]}, made by the caller
        loader = DataLoader(
            Eagle3SampleFileDataset(max_len=max_len, file_list=args["train_batches"]["files"]),
            batch_sampler=args["train_batches"]["batches"],
            collate_fn=create_collate_fn(max_len),
        )
    else:
        loader = DataLoader(
            Eagle3SampleFileDataset(max_len=max_len, file_list=split(folder)[0]),
            batch_size=args["batch"],
            shuffle=True,
            generator=torch.Generator().manual_seed(args["seed"]),
            collate_fn=create_collate_fn(max_len),
        )
    evals = {
        name: DataLoader(
            Eagle3SampleFileDataset(max_len=max_len, file_list=f["files"]),
            batch_sampler=f["batches"],
            collate_fn=create_collate_fn(max_len),
        )
        if isinstance(f, dict)
        else DataLoader(
            Eagle3SampleFileDataset(max_len=max_len, file_list=split(Path(f))[1]),
            batch_size=1,
            collate_fn=create_collate_fn(max_len),
        )
        for name, f in args["held_out"].items()
    }
    trainer = Trainer(
        model,
        TrainerConfig(
            lr=args["lr"], num_epochs=args["epochs"], save_path=args["save"], local_rank="cpu", scheduler_type="none"
        ),
        loader,
    )
    out: dict = {"train_steps": 0, "held_out": {}}
    for epoch in range(args["epochs"]):
        trainer.train_epoch(epoch)
    train = [m["train"] for m in metrics if "train" in m]
    out["train_steps"] = len(train)
    tail = train[-len(loader) :]  # the last epoch
    out["train_loss_last_epoch"] = statistics.mean(m["loss"] for m in tail)
    out["train_loss_first_epoch"] = statistics.mean(m["loss"] for m in train[: len(loader)])
    tenth = max(1, len(train) // 10)
    out["train_loss_first_tenth"] = statistics.mean(m["loss"] for m in train[:tenth])
    out["train_loss_last_tenth"] = statistics.mean(m["loss"] for m in train[-tenth:])
    for name, loader_ in evals.items():
        trainer.val_loader = loader_
        metrics.clear()
        trainer.val_epoch(args["epochs"])
        out["held_out"][name] = next(m["val"] for m in metrics if "val" in m)
    return out


def child(args: dict) -> dict:
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/speculators-fp8-training"))
    parser.add_argument("--phase", choices=["target", "data", "train", "all"], default="all")
    parser.add_argument("--conversations", type=int, default=160)
    parser.add_argument("--target-steps", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-len", type=int, default=512, help="tokens per packed training batch")
    opts = parser.parse_args()
    work = opts.work
    work.mkdir(parents=True, exist_ok=True)
    chats = conversations(opts.conversations)
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    model = bench_model(work / "target", hidden=HIDDEN, layers=LAYERS)
    if opts.phase in ("target", "all"):
        print("target:", train_target(model, chats, opts.target_steps))
    if opts.phase in ("data", "all"):
        for storage in STORAGES:
            generate(model, data, work / f"data-{storage}", storage)
    if opts.phase not in ("train", "all"):
        return
    recon = reconstruction(work)
    results = {}
    for storage in STORAGES:
        held = {"bf16 held-out": str(work / "data-auto")}
        if storage != "auto":
            held["own FP8 held-out"] = str(work / f"data-{storage}")
        results[storage] = child(
            {
                "model": str(model),
                "folder": str(work / f"data-{storage}"),
                "held_out": held,
                "seed": opts.seed,
                "epochs": opts.epochs,
                "batch": opts.batch,
                "lr": 3e-4,
                "max_len": opts.max_len,
                "draft_vocab": 256,
                "save": str(work / f"ckpt-{storage}"),
            }
        )
    with recording(__file__):
        print(json.dumps({"reconstruction": recon, "training": results}, indent=1))
        bpt = recon["bytes_per_token"]
        print(
            f"\nFP8 vs bf16 storage, tiny Llama hidden {HIDDEN} x {LAYERS} layers (briefly trained), "
            f"{recon['tokens']:,} tokens, draft trained {results['auto']['train_steps']} steps on CPU, same seed\n"
        )
        print(
            f"bytes per token (whole files): bf16 {bpt['auto']:.0f}, FP8 {bpt['fp8_e4m3']:.0f} "
            f"({bpt['fp8_e4m3'] / bpt['auto']:.3f}x)"
        )
        print(
            f"reconstruction |deq - x| / row amax: median {recon['element_median']:.2e}, max {recon['element_max']:.2e}"
            f" (bound 6.25e-02); per row ||deq - x|| / ||x||: median {recon['row_median']:.2e}, "
            f"max {recon['row_max']:.2e}\n"
        )
        keys = ["loss"] + [f"{k}_{i}" for k in ("full_acc", "cond_acc") for i in range(3)]
        columns = [
            ("bf16 data", results["auto"], "bf16 held-out"),
            ("FP8 data", results["fp8_e4m3"], "bf16 held-out"),
            ("FP8 data, FP8 eval", results["fp8_e4m3"], "own FP8 held-out"),
        ]
        print(f"{'draft trained on':<26}" + "".join(f"{c[0]:>20}" for c in columns))
        print(f"{'train loss, first epoch':<26}" + "".join(f"{c[1]['train_loss_first_epoch']:>20.4f}" for c in columns))
        print(f"{'train loss, last epoch':<26}" + "".join(f"{c[1]['train_loss_last_epoch']:>20.4f}" for c in columns))
        for key in keys:
            print(
                f"{'held-out ' + key:<26}"
                + "".join(f"{c[1]['held_out'][c[2]][key + '_epoch']:>20.4f}" for c in columns)
            )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(train_draft(json.loads(sys.argv[2]))))
    else:
        main()
