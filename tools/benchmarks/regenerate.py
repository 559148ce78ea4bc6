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
B, and A faster than C. The figures go to docs/benchmarks/regenerate.md (report.py).

    python tools/benchmarks/regenerate.py [--samples 64] [--new-tokens 128] [--rounds 3] [--eager]
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import bench_model, child, engine_env  # noqa: E402
from report import recording  # noqa: E402

SEQ = 1024
SEQS = 16  # max_num_seqs of every engine here


def conversations(path: Path, count: int) -> Path:
    rng, lines = random.Random(0), corpus_lines()
    with path.open("w") as fh:
        for _ in range(count):
            turns = [{"from": "human", "value": " ".join(rng.sample(lines, 3))}, {"from": "gpt", "value": "x"}]
            fh.write(json.dumps({"conversations": turns}) + "\n")
    return path


def llm_generate(args: dict) -> dict:
    """(B) in this process: vLLM's LLM.generate of every conversation's first user turn."""
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
        journal = Path(tmp) / "out" / "regenerated.journal.jsonl"
        generated = (
            sum(len(json.loads(x)["token_ids"]) for x in journal.read_text().splitlines()) if journal.exists() else 0
        )
    tokens, seconds = re.search(r"tokens:\s+(\d+) in ([\d.]+) s of generation", proc.stdout).groups()
    return {"seconds": float(seconds), "tokens": int(tokens), "generated": generated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    opts = ap.parse_args()
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


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(llm_generate(json.loads(sys.argv[1]))))
    else:
        main()
