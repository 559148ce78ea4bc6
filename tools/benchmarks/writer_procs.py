#!/usr/bin/env python3
"""The writers' ceiling: N threads against N processes hashing, testing and writing Kimi-shaped files.

Each file holds bf16 states of 1536-2560 tokens x 4 layers x 7168, read from one shared memory region
(a memfd, as a pool of shared blocks would hold them); each is written as the run's writer does its work:
BLAKE3 and the NaN/Inf test (``checks.finite.bytes_finite``) 4 MiB at a time, the write, fsync, rename.
``--order file`` writes the file in one ``pwritev`` after its last chunk is hashed (the writer's direct
sink: a second read of memory); ``chunk`` writes each chunk right after its test, from the cache.
Threads share one interpreter (the GIL between their C calls); processes share only the memory. With
``--busy`` a thread in the parent runs Python without pause, as vLLM's engine thread does between its waits.
Printed for each count: GiB/s made durable and CPU-s per GiB, for threads and processes, interleaved over
--rounds (medians), and the ratio processes / threads. It answers whether the writers are bound by the
GIL (processes scale on where threads stop) or by the host (both stop at the same rate: memory, cores).

    python tools/benchmarks/writer_procs.py [--dir /dev/shm] [--gib 4] [--counts 8 12 16] [--busy]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from speculators_v016.checks.finite import bytes_finite
from speculators_v016.store import checksum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

HIDDEN, LAYERS, CHUNK = 7168, 4, 4 << 20
ROW = HIDDEN * 2  # bytes of one bf16 row


def write_file(view: memoryview, folder: Path, name: str, order: str) -> None:
    """Hash, test and write ``view`` to ``folder/name`` (temporary name, fsync, rename)."""
    digest, tmp = checksum.new("blake3"), folder / f".tmp-{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        queued, offset = [], 0
        for start in range(0, len(view), CHUNK):
            chunk = view[start : start + CHUNK]
            digest.update(chunk)
            if not bytes_finite(chunk, torch.bfloat16):
                raise RuntimeError(f"{name}: NaN/Inf in synthetic states")
            if order == "chunk":
                while chunk:
                    written = os.pwrite(fd, chunk, offset)
                    offset, chunk = offset + written, chunk[written:]
            else:
                queued.append(chunk)
        while queued:
            written = os.pwritev(fd, queued[:1024], offset)
            offset += written
            while queued and written >= len(queued[0]):
                written -= len(queued.pop(0))
            if written:
                queued[0] = queued[0][written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, folder / name)
    digest.hexdigest()


def run_jobs(view: memoryview, jobs: list, folder: Path, order: str) -> None:
    for name, offset, size in jobs:
        write_file(view[offset : offset + size], folder, name, order)


def child(args: dict) -> None:
    """A process's share of the files: ready once imported and mapped, then it waits for a line on stdin."""
    region = mmap.mmap(args["fd"], args["bytes"], prot=mmap.PROT_READ)
    view = memoryview(region)
    print("ready", flush=True)
    sys.stdin.readline()
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    run_jobs(view, [tuple(j) for j in args["jobs"]], Path(args["folder"]), args["order"])
    now = resource.getrusage(resource.RUSAGE_SELF)
    view.release()
    print(json.dumps({"cpu": now.ru_utime + now.ru_stime - cpu.ru_utime - cpu.ru_stime}), flush=True)


def busy_thread(stop: threading.Event) -> threading.Thread:
    def spin():
        while not stop.is_set():
            sum(range(200))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    return thread


def measure(mode: str, count: int, fd: int, view: memoryview, jobs: list, folder: Path, order: str, busy: bool):
    """(GiB/s, CPU-s per GiB) of the files written by ``count`` threads or processes."""
    shares = [jobs[i::count] for i in range(count)]
    total = sum(size for _, _, size in jobs) / 2**30
    stop = threading.Event()
    spinner = busy_thread(stop) if busy else None
    try:
        if mode == "threads":
            threads = [threading.Thread(target=run_jobs, args=(view, s, folder, order)) for s in shares]
            began, cpu = time.perf_counter(), time.process_time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds, used = time.perf_counter() - began, time.process_time() - cpu
            if spinner is not None:
                used -= seconds  # the spinning thread's own core
        else:
            procs = []
            for share in shares:
                args = {"fd": fd, "bytes": len(view), "jobs": share, "folder": str(folder), "order": order}
                procs.append(subprocess.Popen([sys.executable, __file__, "--child", json.dumps(args)], pass_fds=(fd,),
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))  # fmt: skip
            for p in procs:
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a writer process failed to start: {p.communicate()}")
            began = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            used = 0.0
            for p in procs:  # timed to each process's last rename, not to its exit
                line = p.stdout.readline()
                if not line.strip():
                    raise RuntimeError(f"a writer process failed with status {p.wait()}")
                used += json.loads(line)["cpu"]
            seconds = time.perf_counter() - began
            for p in procs:
                p.communicate()
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()
    for p in folder.iterdir():
        p.unlink()
    return total / seconds, used / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm", help="folder to write in (a temporary folder inside)")
    ap.add_argument("--gib", type=float, default=4.0, help="states written per measurement")
    ap.add_argument("--counts", type=int, nargs="+", default=[8, 12, 16], help="writers (threads or processes)")
    ap.add_argument("--order", choices=["file", "chunk"], nargs="+", default=["file", "chunk"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="a thread in the parent runs Python without pause")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        return child(json.loads(opts.child))
    rng = random.Random(0)
    sizes, total = [], 0
    while total < opts.gib * 2**30:
        sizes.append(rng.randint(1536, 2560) * LAYERS * ROW)
        total += sizes[-1]
    region_bytes = 2 << 30  # files beyond it reuse it from its start
    fd = os.memfd_create("writer-procs")
    os.ftruncate(fd, region_bytes)
    region = mmap.mmap(fd, region_bytes)
    values = np.frombuffer(region, dtype=np.uint16)
    values[:] = np.random.default_rng(0).integers(0, 0x7F00, size=values.size, dtype=np.uint16)  # finite bf16
    view = memoryview(region)
    jobs, offset = [], 0
    for i, size in enumerate(sizes):
        if offset + size > region_bytes:
            offset = 0
        jobs.append((f"data_{i}.safetensors", offset, size))
        offset += size
    folder = Path(tempfile.mkdtemp(prefix="writer-procs-", dir=opts.dir))
    results: dict = {}
    try:
        for _ in range(opts.rounds):
            for order in opts.order:
                for count in opts.counts:
                    for mode in ("threads", "processes"):
                        rate = measure(mode, count, fd, view, jobs, folder, order, opts.busy)
                        results.setdefault((order, count, mode), []).append(rate)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        view.release()
    with recording(__file__):
        print(f"{len(sizes)} files of 1536-2560 tokens x {LAYERS} layers x {HIDDEN} bf16 ({total / 2**30:.2f} GiB) a "
              f"measurement, BLAKE3 and the NaN/Inf test {CHUNK >> 20} MiB at a time, fsync, rename; folder on "
              f"{opts.dir}, {os.cpu_count()} CPUs, {opts.rounds} interleaved round(s), medians"
              f"{'; a thread in the parent runs Python without pause' if opts.busy else ''}")  # fmt: skip
        for order in opts.order:
            how = "one pwritev a file after its hash" if order == "file" else "each chunk written after its test"
            for count in opts.counts:
                med = {m: tuple(statistics.median(r[k] for r in results[(order, count, m)]) for k in (0, 1))
                       for m in ("threads", "processes")}  # fmt: skip
                print(f"  {how}, {count:2} writers: threads {med['threads'][0]:6.2f} GiB/s "
                      f"{med['threads'][1]:.2f} CPU-s/GiB; processes {med['processes'][0]:6.2f} GiB/s "
                      f"{med['processes'][1]:.2f} CPU-s/GiB; processes / threads "
                      f"{med['processes'][0] / med['threads'][0]:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
