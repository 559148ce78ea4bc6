#!/usr/bin/env python3
"""``--regenerate`` (generate and capture in one pass) against vLLM's ``LLM.generate`` alone, side by side.

In one run, on the same model, conversations, engine settings and sampling (greedy, so all three
generate the same tokens), interleaved over --rounds, each in a fresh process:

- (A) ``speculators-data-gen --regenerate``: the target writes the responses and the same pass
  captures and writes their states; its generation phase as its summary reports it;
- (B) ``LLM.generate`` of the same prompts (the chat template's rendering of each user turn), the
  responses alone (no capture), timed around the call;
- (C) the two-pass way: B, then the CLI over B's responses as a dataset (a second prefill of every
  sequence): B's seconds + that run's generation phase.

Rates are generated tokens per second (engine starts excluded from all three). Goal: A >= 0.9x of
B, and A faster than C.

``--multi-turn``: conversations of 3 to 6 exchanges (prompt-only rows: the target answers every user
turn, conditioned on its own earlier answers), and, interleaved over the rounds in the same way:

- (T) ``--regenerate --regenerate-samples turn``: one sample per generated turn;
- (M) ``--regenerate --regenerate-samples auto`` (the default): a turn folded into the sample of the
  conversation's next turn where the next prompt starts with its prompt + its sampled ids;
- (B) ``LLM.generate`` of the same turns: turn by turn, every conversation's k-th turn in one call,
  its prompt the history with the target's earlier answers (as a server returns them).

For T and M: tokens computed (sum over turns of prompt + generated length) per token stored (sum of
the samples' lengths), the samples' bytes on disk, how many samples, generated tokens/s, and the
fraction of turns folded (the journal's ``in_later_sample`` records). A random model's turns rarely
tokenize back to the ids it sampled (nothing would fold), so this mode's target is a tiny Llama
briefly taught a language (on_policy.py's: a line answered by its words reversed and a closing phrase,
here in conversations of several exchanges): its turns are mostly ids its text tokenizes back to.

The figures go to docs/benchmarks/regenerate.md (report.py).

    python tools/benchmarks/regenerate.py [--samples 64] [--new-tokens 128] [--rounds 3] [--eager]
    python tools/benchmarks/regenerate.py --multi-turn [--hidden 128 --layers 4] [--samples 24] [--new-tokens 64]
        [--rounds 2] [--eager]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from speculators_v016.run.demo import corpus_lines
from speculators_v016.run.regenerate import stop_token_ids
from speculators_v016.store.manifest import Manifest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import bench_model, child, engine_env  # noqa: E402
from report import recording  # noqa: E402

CLOSING = "that is all."  # on_policy.py's taught language: a line's words reversed, then this

SEQ = 1024
SEQS = 16  # max_num_seqs of every engine here


def conversations(path: Path, count: int) -> Path:
    rng, lines = random.Random(0), corpus_lines()
    with path.open("w") as fh:
        for _ in range(count):
            turns = [{"from": "human", "value": " ".join(rng.sample(lines, 3))}, {"from": "gpt", "value": "x"}]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    return path


def multi_turn_conversations(path: Path, count: int, seed: int = 0) -> Path:
    """Prompt-only rows of 3 to 6 user turns (corpus lines): the target answers each in order."""
    rng, lines = random.Random(seed), corpus_lines()
    with path.open("w") as fh:
        for _ in range(count):
            turns = [{"from": "human", "value": line} for line in rng.sample(lines, rng.randint(3, 6))]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    return path


def taught_chats(count: int, seed: int = 1) -> list[dict]:
    """Conversations of 1 to 6 exchanges in the taught language: each line answered by its words reversed."""
    rng, lines = random.Random(seed), corpus_lines()
    out = []
    for _ in range(count):
        turns = []
        for line in rng.sample(lines, rng.randint(1, 6)):
            answer = " ".join(reversed(line.split())) + " " + CLOSING
            turns += [{"from": "human", "value": line}, {"from": "gpt", "value": answer}]
        out.append({"conversations": turns})
    return out


def taught_model(hidden: int, layers: int, steps: int) -> Path:
    """The multi-turn target: a bench Llama briefly taught the language (built and taught once, cached)."""
    from fp8_training import train_target  # noqa: PLC0415 - torch training only where this mode runs

    model = bench_model(Path(f"/tmp/speculators-v016-bench/regen-taught-{hidden}x{layers}-{steps}"), hidden, layers)
    train_target(model, taught_chats(600), steps)
    return model


def multi_turn_generate(llm, tokenizer, rows: list[dict], params) -> dict:
    """(B) multi-turn: every conversation's k-th turn in one ``LLM.generate`` call, after its (k-1)-th."""
    from vllm.inputs import TokensPrompt  # noqa: PLC0415 - vLLM only in the child that runs it

    users = [[t["value"] for t in r["conversations"] if t["from"] == "human"] for r in rows]
    histories: list[list[dict]] = [[] for _ in rows]
    tokens = computed = 0
    start = time.perf_counter()
    for k in range(max(len(u) for u in users)):
        live = [i for i, u in enumerate(users) if k < len(u)]
        for i in live:
            histories[i].append({"role": "user", "content": users[i][k]})
        prompts = [tokenizer.apply_chat_template(histories[i], add_generation_prompt=True) for i in live]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        for i, prompt, out in zip(live, prompts, outputs):
            ids = out.outputs[0].token_ids
            histories[i].append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
            tokens += len(ids)
            computed += len(prompt) + len(ids)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "computed": computed}


def llm_generate(args: dict) -> dict:
    """(B) in this process: vLLM's LLM.generate of every conversation's first user turn (``multi_turn``:
    of every user turn, turn by turn, each after the target's earlier answers)."""
    from vllm import LLM, SamplingParams  # noqa: PLC0415 - vLLM only in the child that runs it
    from vllm.inputs import TokensPrompt  # noqa: PLC0415 - the same

    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    rows = [json.loads(x) for x in Path(args["data"]).read_text().splitlines()]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["conversations"][0]["value"]}], add_generation_prompt=True
        )
        for r in rows
    ]
    llm = LLM(
        model=args["model"],
        dtype="float32",
        max_model_len=SEQ + 1,
        enforce_eager=args["eager"],
        max_num_seqs=SEQS,
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=args["new_tokens"], stop_token_ids=sorted(stop_token_ids(tokenizer, args["model"]))
    )
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]], params, use_tqdm=False)  # warm
    if args.get("multi_turn"):
        return multi_turn_generate(llm, tokenizer, rows, params)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outputs]
    with open(args["responses"], "w") as fh:
        for row, text in zip(rows, texts):
            turns = [row["conversations"][0], {"from": "gpt", "value": text}]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "tokens": tokens}


def cli(model: str, data: Path, eager: bool, extra: list[str]) -> dict:
    """A CLI run's generation phase (its summary), and the generated tokens it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "speculators_v016.cli", "--target-model-path", model]
        cmd += ["--train-data-path", str(data), "--output-dir", f"{tmp}/out", "--seq-length", str(SEQ)]
        cmd += ["--dtype", "float32", "--token-freq-path", "", "--no-progress", "--num-preprocessing-workers", "1"]
        cmd += ["--max-num-seqs", str(SEQS)] + (["--enforce-eager"] if eager else []) + extra
        proc = subprocess.run(cmd, capture_output=True, text=True, env=engine_env(), cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
        out = Path(tmp) / "out"
        journal = out / "regenerated.journal.jsonl"
        records = [json.loads(x) for x in journal.read_text().splitlines()] if journal.exists() else []
        entries = Manifest(out).entries().values()
        folder = {
            "generated": sum(len(r["token_ids"]) for r in records),
            "turns": len(records),
            "folded": sum(bool(r.get("in_later_sample")) for r in records),
            "computed": sum(r["prompt_tokens"] + len(r["token_ids"]) for r in records),
            "samples": len(entries),
            "stored": sum(e.tokens for e in entries),
            "bytes": sum((out / e.file).stat().st_size for e in entries),
            "shapes": json.loads((out / "data_config.json").read_text())["speculators_v016"]["last_run"].get(
                "conversations", {}
            ),
        }
    tokens, seconds = re.search(r"tokens:\s+(\d+) in ([\d.]+) s of generation", proc.stdout).groups()
    return {"seconds": float(seconds), "tokens": int(tokens), **folder}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--multi-turn", action="store_true", help="conversations of 3 to 6 exchanges: T, M and B")
    ap.add_argument("--teach-steps", type=int, default=150, help="--multi-turn: steps teaching the target")
    opts = ap.parse_args()
    if opts.multi_turn:
        multi_turn(opts)
        return
    model = str(
        bench_model(Path(f"/tmp/speculators-v016-bench/regen-{opts.hidden}x{opts.layers}"), opts.hidden, opts.layers)
    )
    runs: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = conversations(Path(tmp) / "chats.jsonl", opts.samples)
        responses = Path(tmp) / "responses.jsonl"
        regen = ["--regenerate", "--temperature", "0", "--max-new-tokens", str(opts.new_tokens)]
        for _ in range(opts.rounds):
            a = cli(model, data, opts.eager, regen)
            b = child(
                __file__,
                {"model": model, "data": str(data), "responses": str(responses), "eager": opts.eager}
                | {"new_tokens": opts.new_tokens},
            )
            second = cli(model, responses, opts.eager, [])
            runs["A"].append(a["generated"] / a["seconds"])
            runs["B"].append(b["tokens"] / b["seconds"])
            runs["C"].append(b["tokens"] / (b["seconds"] + second["seconds"]))
            tokens = {"A": a["generated"], "B": b["tokens"]}
    med = {k: statistics.median(v) for k, v in runs.items()}
    with recording(__file__):
        print(
            f"bench Llama hidden {opts.hidden}, {opts.layers} layers, fp32, {'eager' if opts.eager else 'compiled'}, "
            f"{opts.samples} conversations, greedy, up to {opts.new_tokens} new tokens, max_num_seqs {SEQS}, "
            f"{opts.rounds} round(s), medians of generated tokens/s"
        )
        print(f"  generated tokens: A {tokens['A']:,}, B {tokens['B']:,} (greedy: the same responses)")
        for key, label in (
            ("A", "(A) --regenerate, captured and written"),
            ("B", "(B) LLM.generate alone"),
            ("C", "(C) B, then the CLI over its text"),
        ):
            print(f"  {label:42} {med[key]:10,.0f} tokens/s   runs: {', '.join(f'{r:,.0f}' for r in runs[key])}")
        per_round = [a / b for a, b in zip(runs["A"], runs["B"])]
        print(f"  ratio A / B  {med['A'] / med['B']:.2f}x (per round {', '.join(f'{r:.2f}' for r in per_round)})")
        print(f"  ratio A / C  {med['A'] / med['C']:.2f}x")


MODES = {
    "T": ("(T) --regenerate-samples turn", ["--regenerate-samples", "turn"]),
    "M": ("(M) --regenerate-samples auto", ["--regenerate-samples", "auto"]),
}


def multi_turn(opts) -> None:
    """T, M and B on conversations of 3 to 6 exchanges, interleaved over the rounds (the order rotates)."""
    model = str(taught_model(opts.hidden, opts.layers, opts.teach_steps))
    rates: dict[str, list[float]] = {"T": [], "M": [], "B": []}
    last: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = multi_turn_conversations(Path(tmp) / "chats.jsonl", opts.samples)
        regen = ["--regenerate", "--temperature", "0", "--max-new-tokens", str(opts.new_tokens)]
        for round_ in range(opts.rounds):
            order = ["T", "M", "B"][round_ % 3 :] + ["T", "M", "B"][: round_ % 3]
            for key in order:
                if key == "B":
                    args = {"model": model, "data": str(data), "responses": str(Path(tmp) / "unused.jsonl")}
                    run = child(
                        __file__, args | {"eager": opts.eager, "new_tokens": opts.new_tokens, "multi_turn": True}
                    )
                    run["generated"] = run["tokens"]
                else:
                    run = cli(model, data, opts.eager, regen + MODES[key][1])
                rates[key].append(run["generated"] / run["seconds"])
                last[key] = run
    med = {k: statistics.median(v) for k, v in rates.items()}
    t, m, b = last["T"], last["M"], last["B"]
    with recording(__file__):
        print(
            f"multi-turn: bench Llama hidden {opts.hidden}, {opts.layers} layers, briefly taught a language "
            f"({opts.teach_steps} steps), fp32, {'eager' if opts.eager else 'compiled'}, {opts.samples} conversations "
            f"of 3 to 6 exchanges ({t['turns']} turns), greedy, up to {opts.new_tokens} new tokens, max_num_seqs "
            f"{SEQS}, {opts.rounds} round(s) (order rotated), medians of generated tokens/s"
        )
        print(
            f"  generated tokens: T {t['generated']:,}, M {m['generated']:,}, B {b['generated']:,}; "
            f"tokens computed (prompts + generated): T {t['computed']:,}, M {m['computed']:,}, B {b['computed']:,}"
        )
        print(f"  {'':34}{'samples':>9}{'tokens stored':>15}{'computed/stored':>17}{'bytes':>15}{'tokens/s':>10}")
        for key in ("T", "M"):
            r = last[key]
            print(
                f"  {MODES[key][0]:34}{r['samples']:>9,}{r['stored']:>15,}{r['computed'] / r['stored']:>17.2f}"
                f"{r['bytes']:>15,}{med[key]:>10,.0f}   runs: {', '.join(f'{x:,.0f}' for x in rates[key])}"
            )
        print(
            f"  {'(B) LLM.generate, turn by turn':34}{'':>56}{med['B']:>10,.0f}   runs: "
            + ", ".join(f"{x:,.0f}" for x in rates["B"])
        )
        for key in ("T", "M"):
            r = last[key]
            print(
                f"  {key}: turns folded {r['folded']}/{r['turns']} ({r['folded'] / r['turns']:.0%}); conversations {r['shapes']}"
            )
        print(
            f"  M / T: tokens stored {m['stored'] / t['stored']:.2f}x, bytes {m['bytes'] / t['bytes']:.2f}x, "
            f"samples {m['samples'] / t['samples']:.2f}x, tokens/s {med['M'] / med['T']:.2f}x "
            f"(per round {', '.join(f'{x / y:.2f}' for x, y in zip(rates['M'], rates['T']))})"
        )
        print(f"  T / B {med['T'] / med['B']:.2f}x, M / B {med['M'] / med['B']:.2f}x (tokens/s)")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(llm_generate(json.loads(sys.argv[1]))))
    else:
        main()
