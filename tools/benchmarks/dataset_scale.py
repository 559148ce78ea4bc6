#!/usr/bin/env python3
"""Preparing datasets at a draft's scale: a shard's cost is its own rows', memory flat in the dataset's size.

Synthetic conversation rows (``messages``, 1-3 exchanges a row, words of the demo's corpus) and the demo's
tokenizer (its trained tokenizer and ChatML template, as ``speculators-data-gen demo`` builds it). Each figure is
measured in a fresh process (peak RSS is that process's, the imports' baseline said beside it):

* **(a) shard 0 of a sharded run**: 10k rows in 100 shards vs 100k rows in 1,000 shards (100 samples each):
  wall time and peak RSS of its preparation (index the rows, order them, tokenize its own 100): the first shard
  on a machine (the row index read from the file), another shard (the index from the prepared-rows cache, its own
  rows tokenized, the input's sha256 remembered by its stat: store/digest_memo.py) and shard 0 again (a resume:
  nothing tokenized); beside them, what every shard did before (all 10k rows tokenized). The first shard reads
  the whole input (the index: every row, its sha256) and grows with it; what is left in proportion to the
  dataset for the others is the cached index's check (its sha256, 24 bytes a row) and the run's order (8 bytes a
  row);
* **(b) a whole run's rows streamed as a run feeds them** (one shard, no cache) at 10k, 100k and 1M rows: rows/s,
  bytes a token of the prepared arrays, peak RSS, and the time to the first sample.

    python tools/benchmarks/dataset_scale.py [--sizes 10000 100000 1000000] [--workers 2] [--stream-limit ROWS]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_rows(path: Path, count: int, seed: int = 0) -> None:
    """``count`` conversations of 1-3 exchanges, words of the demo corpus."""
    from speculators_v016.run.demo import corpus_lines  # noqa: PLC0415 - the child's imports are measured

    words = " ".join(corpus_lines()).split()
    draw = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(count):
            messages = []
            for _ in range(draw.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(draw.choices(words, k=draw.randint(5, 30)))})
                messages.append({"role": "assistant", "content": " ".join(draw.choices(words, k=draw.randint(10, 60)))})
            fh.write(json.dumps({"messages": messages}) + "\n")


def child_main(args: dict) -> dict:
    """One measurement, in this fresh process."""
    from collections import Counter  # noqa: PLC0415 - imports before the baseline

    import numpy as np  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from speculators_v016.run.prefill import PrefillWork  # noqa: PLC0415
    from speculators_v016.run.prepared import Options, plan_run  # noqa: PLC0415
    from speculators_v016.store import digest_memo  # noqa: PLC0415

    hashed = []  # the input files read through sha256 (else their digest was remembered by their stat)
    sha = digest_memo.file_sha256
    digest_memo.file_sha256 = lambda path: hashed.append(path) or sha(path)

    tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])
    baseline = peak_mib()
    cache = Path(args["cache"]) if args.get("cache") else None
    options = Options(2048, num_proc=args["workers"])
    started = time.perf_counter()
    plan = plan_run([args["data"]], tokenizer, options, cache=cache)
    indexed = time.perf_counter() - started
    shard = args.get("shard", 0)
    work = PrefillWork(plan, args["shards"], shard)
    pending = work.shard(args["shards"], shard)
    tokens = samples = 0
    arrays = Counter()  # the bytes of the prepared arrays of the samples: uint32 ids, uint8 masks, int64 offsets
    try:
        work.begin(pending)
        first = time.perf_counter() - started
        limit = args.get("limit") or len(pending)
        for _name, ids in work.feed(pending):
            samples += 1
            tokens += len(ids)
            if samples == 1:
                first = time.perf_counter() - started
            if samples >= limit:
                break
        else:
            for _ in work.feed(None):
                pass
    finally:
        work.close()
    seconds = time.perf_counter() - started
    arrays["ids"] = tokens * np.dtype(np.uint32).itemsize
    arrays["masks"] = tokens
    arrays["offsets"] = (samples + 1) * 8
    return {
        "rows": samples + work.dropped,
        "indexed_rows": len(pending),
        "samples": samples,
        "tokens": tokens,
        "seconds": seconds,
        "indexed": indexed,
        "first": first,
        "peak": peak_mib(),
        "workers_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "baseline": baseline,
        "bytes_per_token": sum(arrays.values()) / max(tokens, 1),
        "tokenized": plan.built,
        "hashed": len(hashed),
    }


def run_child(args: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--workers", type=int, default=2, help="tokenizing processes (--num-preprocessing-workers)")
    ap.add_argument(
        "--stream-limit", type=int, default=None, help="stream at most this many rows of each size (all indexed)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        print(json.dumps(child_main(json.loads(opts.child))))
        return
    from speculators_v016.run.demo import corpus_lines  # noqa: PLC0415 - the parent's only heavy import
    from speculators_v016.testing.tiny_models import DEFAULT_CORPUS, train_tokenizer  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="dataset-scale-") as tmp:
        tmp = Path(tmp)
        train_tokenizer(DEFAULT_CORPUS + corpus_lines(), 512).save_pretrained(tmp / "tokenizer")
        files = {}
        for size in sorted({10_000, 100_000, *opts.sizes}):
            files[size] = tmp / f"rows-{size}.jsonl"
            write_rows(files[size], size)
        time.sleep(2.5)  # the inputs settled: their sha256 may be remembered (store/digest_memo.py's SETTLE_NS)
        common = {"tokenizer": str(tmp / "tokenizer"), "workers": opts.workers}
        shard_runs = {}
        for size, shards in ((10_000, 100), (100_000, 1_000)):
            cache = tmp / f"cache-{size}"
            mine = {**common, "data": str(files[size]), "shards": shards, "cache": str(cache)}
            cold = run_child(mine)  # the first shard on the machine: the row index read from the file
            other = run_child({**mine, "shard": 1})  # another shard: the index from the cache, its rows tokenized
            again = run_child(mine)  # shard 0 again (a resume, a second run): nothing tokenized
            shard_runs[size] = (shards, cold, other, again)
        every = run_child({**common, "data": str(files[10_000]), "shards": 1})
        whole = {
            size: run_child({**common, "data": str(files[size]), "shards": 1, "limit": opts.stream_limit})
            for size in opts.sizes
        }
        with recording(__file__):
            print(f"demo tokenizer, --seq-length 2048, {opts.workers} tokenizing processes; a fresh process per figure")
            print("(a) shard 0 (100 samples): its preparation's wall time and peak RSS (imports' baseline in brackets)")
            labels = (
                "first shard on the machine (index read)",
                "another shard (index and sha256 cached)",
                "shard 0 again (all cached)",
            )
            for size, (shards, *runs) in shard_runs.items():
                for label, r in zip(labels, runs, strict=True):
                    print(
                        f"  {size:>7,} rows / {shards:>5,} shards, {label:42}: {r['seconds']:6.2f} s "
                        f"(index {r['indexed']:5.2f} s), peak {r['peak']:6.0f} MiB ({r['baseline']:.0f}), "
                        f"{r['tokenized']} rows tokenized, input {'hashed' if r['hashed'] else 'not read to be named'}"
                    )
            small, large = shard_runs[10_000], shard_runs[100_000]
            for i, label in ((1, "first shard"), (2, "another shard"), (3, "shard 0 again")):
                print(
                    f"  100k/1,000 vs 10k/100, {label}: {large[i]['seconds'] / small[i]['seconds']:.2f}x the time, "
                    f"{large[i]['peak'] / small[i]['peak']:.2f}x the peak RSS"
                )
            print(
                f"  before: every shard tokenized every row: 10k rows {every['seconds']:.1f} s, peak {every['peak']:.0f} "
                f"MiB: {every['seconds'] / small[1]['seconds']:.0f}x the first shard's time now"
            )
            print("(b) one shard, every row streamed as a run feeds it (no cache)")
            for size, r in whole.items():
                streamed = "" if r["rows"] == r["indexed_rows"] else f" (the first {r['rows']:,} streamed)"
                print(
                    f"  {size:>9,} rows{streamed}: {r['rows'] / r['seconds']:7,.0f} rows/s ({r['seconds']:7.1f} s, index "
                    f"{r['indexed']:.1f} s), {r['tokens']:,} tokens, {r['bytes_per_token']:.2f} bytes a token, "
                    f"peak {r['peak']:.0f} MiB ({r['baseline']:.0f} after imports; a worker's {r['workers_peak']:.0f}), "
                    f"first sample after {r['first']:.2f} s"
                )


if __name__ == "__main__":
    main()
