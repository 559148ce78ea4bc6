#!/usr/bin/env python3
"""Online states, producer -> consumer through each backend at Kimi-shaped sizes, against a raw copy and a run's files.

What `speculators-data-gen serve` does with each finished sample, after the
engine, and what `OnlineSampleDataset` does before upstream's reader, with the
service's own classes: the publisher encodes the sample (safetensors parts, no
joined copy for the folder), waits under the cap and publishes it
(:class:`ServeDir` into ``--dir``, or :class:`MooncakeBackend` into a pinned
segment of a Mooncake store whose master it starts, over TCP); the consumer
fetches it (the folder's file, or a private copy of the store's object), loads it
with the run's loader (what upstream's reader calls) and deletes it. Samples are
Kimi-K2.5-shaped: hidden 7168, 4 layers, bf16, ``--tokens`` tokens (56 KiB a token).

Measured side by side, interleaved over ``--rounds``, medians printed:

* **raw copy**: one in-process copy of the same bytes (the memory's own ceiling here);
* **run's files**: what an offline run pays per sample on the same folder, its
  durable write (temporary name, fsync, rename) and a read back, no engine;
* **folder** and **mooncake**: producer and consumer threads in one process (two
  processes' worth of work on this machine's cores), GiB/s of samples delivered;
* **wait**: the fraction of a consumer's time spent waiting for its next sample
  when it needs ``--compute`` times the producer's time per sample (a trainer
  slower than the producer: near 0 is the goal; the cap keeps memory bounded).

    python tools/benchmarks/online.py [--dir /dev/shm/online-bench] [--tokens 2048] [--samples 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from speculators_v016.online.readers import FolderReader, MooncakeReader
from speculators_v016.run.console import private_dir
from speculators_v016.serve.folder import ServeDir
from speculators_v016.serve.mooncake import MooncakeBackend
from speculators_v016.store.atomic_files import write_durable
from speculators_v016.store.sample_format import encode_parts, load_sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

HIDDEN, LAYERS = 7168, 4
GIB = 1 << 30


def kimi_sample(tokens: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    states = [torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    ids = torch.randint(0, 160_000, (tokens,), generator=gen)
    return {"input_ids": ids, "loss_mask": torch.ones(tokens, dtype=torch.long), "hidden_states": states}


def sample_bytes(sample: dict) -> int:
    return sum(memoryview(p).nbytes for p in encode_parts(sample, "safetensors", list(range(LAYERS))))


def raw_copy(samples: list[dict]) -> float:
    start = time.perf_counter()
    for s in samples:
        for h in s["hidden_states"]:
            h.clone()
    return time.perf_counter() - start


def run_files(samples: list[dict], folder: Path) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, s in enumerate(samples):
        write_durable(folder, f"data_{i}.safetensors", encode_parts(s, "safetensors", list(range(LAYERS))))
        load_sample(folder / f"data_{i}.safetensors", dequantize_to=None)
        (folder / f"data_{i}.safetensors").unlink()
    return time.perf_counter() - start


def through(backend, reader, samples: list[dict], compute: float = 0.0) -> tuple[float, float]:
    """Producer thread publishes every sample; the consumer reads, loads, deletes each, then 'computes'
    ``compute`` seconds. Returns (seconds, the consumer's waiting fraction)."""
    handles: queue.Queue = queue.Queue()
    stopped = threading.Event()

    def produce():
        try:
            for s in samples:
                parts = encode_parts(s, "safetensors", list(range(LAYERS)))
                nbytes = sum(memoryview(p).nbytes for p in parts)
                backend.reserve(nbytes, stopped)
                handles.put(backend.publish(parts, nbytes, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            handles.put(exc)

    start = time.perf_counter()
    producer = threading.Thread(target=produce)
    producer.start()
    waited = 0.0
    for _ in samples:
        t0 = time.perf_counter()
        handle = handles.get()
        waited += time.perf_counter() - t0
        if isinstance(handle, BaseException):
            raise handle
        taken = reader.fetch(handle)  # checked as OnlineSampleDataset checks it: name, size, frame, digest
        load_sample(taken.path, dequantize_to=None)
        taken.release()
        if compute:
            time.sleep(compute)
    producer.join()
    total = time.perf_counter() - start
    return total, waited / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm/speculators-online-bench"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap-samples", type=int, default=4, help="--max-published-bytes, in samples")
    ap.add_argument("--compute", type=float, default=2.0, help="consumer time per sample, in producer times")
    args = ap.parse_args()
    samples = [kimi_sample(args.tokens, i) for i in range(args.samples)]
    per_sample = sample_bytes(samples[0])
    cap = args.cap_samples * per_sample
    total = per_sample * len(samples)
    shutil.rmtree(args.dir, ignore_errors=True)
    folder = ServeDir(args.dir / "serve", cap, 3600.0).open()
    mooncake = MooncakeBackend("auto", "127.0.0.1", cap, 3600.0, log_dir=private_dir()).open(per_sample + (64 << 10))
    readers = {
        "folder": FolderReader(args.dir / "serve"),
        "mooncake": MooncakeReader(mooncake.address, per_sample << 1),
    }
    backends = {"folder": folder, "mooncake": mooncake}
    seconds: dict[str, list[float]] = {k: [] for k in ("raw copy", "run's files", "folder", "mooncake")}
    waits: dict[str, list[float]] = {"folder": [], "mooncake": []}
    try:
        for _ in range(args.rounds):
            seconds["raw copy"].append(raw_copy(samples))
            seconds["run's files"].append(run_files(samples, args.dir / "run"))
            for name, backend in backends.items():
                seconds[name].append(through(backend, readers[name], samples)[0])
            for name, backend in backends.items():
                produce_time = statistics.median(seconds[name]) / len(samples)
                waits[name].append(through(backend, readers[name], samples, args.compute * produce_time)[1])
    finally:
        folder.close()
        mooncake.close()
        shutil.rmtree(args.dir, ignore_errors=True)
    rate = {k: total / statistics.median(v) / GIB for k, v in seconds.items()}
    out = [
        f"{len(samples)} Kimi-shaped samples (hidden {HIDDEN}, {LAYERS} layers, bf16, {args.tokens} tokens: "
        f"{per_sample / 2**20:.0f} MiB each), cap {args.cap_samples} samples, {args.rounds} rounds interleaved, "
        f"{os.cpu_count()} cores; medians",
    ]
    raw, files = rate["raw copy"], rate["run's files"]
    for name in seconds:
        extra = ""
        if name in waits:
            extra = (f"  {rate[name] / raw:.2f}x raw copy, {rate[name] / files:.2f}x the run's files; consumer "
                     f"waiting {100 * statistics.median(waits[name]):.1f}% of its time at {args.compute:g}x the "
                     "producer's time per sample")  # fmt: skip
        out.append(f"  {name:12} {rate[name]:6.2f} GiB/s{extra}")
    with recording(__file__):
        print("\n".join(out))


if __name__ == "__main__":
    main()
