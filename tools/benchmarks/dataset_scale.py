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
  the whole input once (the index: every row, its sha256) and grows with it: its time is shown whole, as the
  one-time index read (plan_run) and the rest, each compared on its own; what is left in proportion to the dataset
  for the others is the cached index's check (its sha256, 14 bytes a row) and the run's order (4 bytes a row).
  Each figure is the median of several measurements (``--repeat``; time.perf_counter): the first shard and
  another shard in a fresh process each (a fresh cache for each first shard, another shard index for each other
  one), shard 0 again ``--again-repeat`` times in one process (a few milliseconds each);
* **(b) a whole run's rows streamed as a run feeds them** (one shard, no cache) at 10k, 100k and 1M rows: rows/s,
  bytes a token of the prepared arrays, peak RSS, and the time to the first sample. Each sample fed is finished
  (``PrefillWork.finish``, as the engine's loop does: its loss mask handed over and let go of); the page's
  measurements of code d063a50 and before did not, and the masks of every sample fed stayed in memory (about
  30 MiB at 50,000 samples) in their peak RSS, a cost no run has.

    python tools/benchmarks/dataset_scale.py [--sizes 10000 100000 1000000] [--workers 2] [--stream-limit ROWS]
        [--repeat 5] [--again-repeat 20]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
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
    """One measurement (``repeat`` of them, medians), in this fresh process."""
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

    def once() -> dict:
        hashed.clear()
        started = time.perf_counter()
        plan = plan_run([args["data"]], tokenizer, options, cache=cache)
        indexed = time.perf_counter() - started
        shard = args.get("shard", 0)
        work = PrefillWork(plan, args["shards"], shard)
        pending = work.shard(args["shards"], shard)
        tokens = samples = 0
        try:
            work.begin(pending)
            first = time.perf_counter() - started
            limit = args.get("limit") or len(pending)
            for name, ids in work.feed(pending):
                work.finish(name, ids, None)  # as the engine's loop does once the sample is back
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
        return {
            "rows": samples + work.dropped,
            "indexed_rows": len(pending),
            "samples": samples,
            "tokens": tokens,
            "seconds": seconds,
            "indexed": indexed,
            "first": first,
            "tokenized": plan.built,
            "hashed": len(hashed),
        }

    runs = [once() for _ in range(args.get("repeat", 1))]
    out = {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in ("seconds", "indexed", "first")}}
    arrays = Counter()  # the bytes of the prepared arrays of the samples: uint32 ids, uint8 masks, int64 offsets
    arrays["ids"] = out["tokens"] * np.dtype(np.uint32).itemsize
    arrays["masks"] = out["tokens"]
    arrays["offsets"] = (out["samples"] + 1) * 8
    out.update(
        times=[r["seconds"] for r in runs],
        peak=peak_mib(),
        workers_peak=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        baseline=baseline,
        bytes_per_token=sum(arrays.values()) / max(out["tokens"], 1),
    )
    return out


def run_child(args: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict]) -> dict:
    """Measurements of one figure in several processes: the median of each time, every time, the largest peak."""
    out = {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in ("seconds", "indexed", "first")}}
    out.update(times=[t for r in runs for t in r["times"]], peak=max(r["peak"] for r in runs))
    out.update(hashed=min(r["hashed"] for r in runs), tokenized=max(r["tokenized"] for r in runs))
    return out


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def spread(times: list[float]) -> str:
    return f"{len(times)} runs, {min(times) * 1000:.1f}-{max(times) * 1000:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--workers", type=int, default=2, help="tokenizing processes (--num-preprocessing-workers)")
    ap.add_argument(
        "--stream-limit", type=int, default=None, help="stream at most this many rows of each size (all indexed)"
    )
    ap.add_argument("--repeat", type=int, default=5, help="processes measuring a first shard, and another shard")
    ap.add_argument("--again-repeat", type=int, default=20, help="measurements of shard 0 again, in one process")
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
            mine = {**common, "data": str(files[size]), "shards": shards}
            # the first shard on the machine: the row index read from the file, each time with a fresh cache
            cold = [run_child({**mine, "cache": str(tmp / f"cache-{size}-{i}")}) for i in range(opts.repeat)]
            cache = str(tmp / f"cache-{size}-0")
            # another shard: the index from the cache, its own rows tokenized (shards 1, 2, ...: each its first time)
            other = [run_child({**mine, "cache": cache, "shard": 1 + i}) for i in range(opts.repeat)]
            # shard 0 again (a resume, a second run): nothing tokenized, measured again and again in one process
            again = run_child({**mine, "cache": cache, "repeat": opts.again_repeat})
            shard_runs[size] = (shards, median_of(cold), median_of(other), median_of([again]))
        every = run_child({**common, "data": str(files[10_000]), "shards": 1})
        whole = {
            size: run_child({**common, "data": str(files[size]), "shards": 1, "limit": opts.stream_limit})
            for size in opts.sizes
        }
        with recording(__file__):
            print(f"demo tokenizer, --seq-length 2048, {opts.workers} tokenizing processes; fresh processes per figure")
            print(
                "(a) shard 0 (100 samples): its preparation's wall time, median of the runs (time.perf_counter), as the "
                "index read (plan_run: the row index, read or cached, and the order) + the rest; peak RSS (imports' "
                "baseline in brackets)"
            )
            labels = (
                "first shard on the machine (index read)",
                "another shard (index and sha256 cached)",
                "shard 0 again (all cached)",
            )
            for size, (shards, *runs) in shard_runs.items():
                for label, r in zip(labels, runs, strict=True):
                    print(
                        f"  {size:>7,} rows / {shards:>5,} shards, {label:42}: {ms(r['seconds'])} = index read "
                        f"{ms(r['indexed'])} + the rest {ms(r['seconds'] - r['indexed'])} ({spread(r['times'])}), "
                        f"peak {r['peak']:6.0f} MiB ({r['baseline']:.0f}), {r['tokenized']} rows tokenized, "
                        f"input {'hashed' if r['hashed'] else 'not read to be named'}"
                    )
            small, large = shard_runs[10_000], shard_runs[100_000]
            for i, label in ((1, "first shard"), (2, "another shard"), (3, "shard 0 again")):
                a, b = small[i], large[i]
                rest = (b["seconds"] - b["indexed"]) / (a["seconds"] - a["indexed"])
                print(
                    f"  100k/1,000 vs 10k/100, {label}: {b['seconds'] / a['seconds']:.2f}x the time (index read "
                    f"{b['indexed'] / a['indexed']:.2f}x, for 10x the rows; without it {rest:.2f}x), "
                    f"{b['peak'] / a['peak']:.2f}x the peak RSS"
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
