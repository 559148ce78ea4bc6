#!/usr/bin/env python3
"""Generator throughput (async on / off) against vLLM's LLM.generate(max_tokens=1), side by side.

Every measurement runs in its own process on the same prompts and engine
settings, interleaved over --rounds so machine noise hits all alike; the
script prints tokens/s, their ratios (medians), and the generator's peak RSS
at N and 4N prompts (streamed, results dropped as a writer would).

    python tools/benchmarks/generator_vs_llm.py [--prompts 64] [--length 256] [--rounds 2] [--eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import bench_model, child, peak_rss_mib, prompts  # noqa: E402

LAYERS = [2, 4, 5, 7]


def measure(args: dict) -> dict:
    """In the child: start the engine, warm up, then time one pass over the prompts."""
    batch = prompts(args["prompts"], args["length"])
    warm = prompts(4, args["length"], seed=1)
    engine = dict(max_model_len=args["length"] + 8, dtype="float32", enforce_eager=args["eager"],
                  max_num_seqs=args["max_num_seqs"], max_num_batched_tokens=args["batched_tokens"])
    if args["mode"] == "llm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=args["model"], enable_prefix_caching=False, **engine)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        as_prompts = [{"prompt_token_ids": p} for p in batch]
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
        start = time.perf_counter()
        llm.generate(as_prompts, params, use_tqdm=False)
    else:
        from speculators_v016.generator import VllmHiddenStatesGenerator

        gen = VllmHiddenStatesGenerator(args["model"], layer_ids=LAYERS, async_scheduling=args["mode"] == "async",
                                        **engine)
        gen.generate(warm)
        start = time.perf_counter()
        for _ in gen.stream(batch):  # dropped, as a writer would after saving
            pass
    seconds = time.perf_counter() - start
    return {"tokens_per_s": len(batch) * args["length"] / seconds, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="eager engines (default: compiled)")
    ap.add_argument("--model-dir", default="/tmp/speculators-v016-bench/model")
    opts = ap.parse_args()
    model = str(bench_model(Path(opts.model_dir)))
    base = dict(model=model, length=opts.length, eager=opts.eager, max_num_seqs=32, batched_tokens=8192)
    rates: dict[str, list[float]] = {"async": [], "sync": [], "llm": []}
    for _ in range(opts.rounds):
        for mode in rates:
            rates[mode].append(child(__file__, {**base, "mode": mode, "prompts": opts.prompts})["tokens_per_s"])
    rss = {n: child(__file__, {**base, "mode": "async", "prompts": n})["peak_rss_mib"]
           for n in (opts.prompts, 4 * opts.prompts)}
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{opts.prompts} prompts x {opts.length} tokens, {'eager' if opts.eager else 'compiled'} engines, "
          f"{opts.rounds} round(s), medians")
    for mode, label in (("async", "generator, async scheduling"), ("sync", "generator, sync scheduling"),
                        ("llm", "LLM.generate(max_tokens=1)")):
        print(f"  {label:30} {med[mode]:10,.0f} tokens/s   (runs: {', '.join(f'{r:,.0f}' for r in rates[mode])})")
    print(f"  ratio async / LLM.generate     {med['async'] / med['llm']:.2f}x")
    print(f"  ratio sync  / LLM.generate     {med['sync'] / med['llm']:.2f}x")
    print(f"  ratio async / sync             {med['async'] / med['sync']:.2f}x")
    n, n4 = opts.prompts, 4 * opts.prompts
    print(f"  peak RSS (generator, streamed) {rss[n]:,.0f} MiB at {n} prompts, {rss[n4]:,.0f} MiB at {n4}: "
          f"{rss[n4] / rss[n]:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(measure(json.loads(sys.argv[1]))))
    else:
        main()
