#!/usr/bin/env python3
"""The host path without vLLM: Kimi-shaped steps from a ring slot to durable, listed files, against the disk.

Synthetic steps of 8192 tokens x 4 layers x 7168 (bf16, 448 MiB) sit in the slots of a real :class:`SlotRing`,
as the worker leaves them; the engine-side :class:`Assembler` copies each request's rows into the run's buffer
pool, and the run's :class:`SampleWriter` (NaN/Inf check, degenerate-row screen, digest, write, fsync, rename,
group commit) puts them in a real folder. Samples have 1536-2560 tokens (2k on average), so some straddle two
steps. Printed, interleaved over --rounds (medians): GiB/s of samples made durable and listed, for each
--workers count, against raw ``write`` + ``fsync`` of the same bytes to the same folder (one stream, and as
many streams as the most workers) and against each piece of the writer's CPU alone on one thread (BLAKE3,
sha256, the NaN/Inf check), and a raw write with ``O_DIRECT`` (one stream); the writer with BLAKE3 (the
default, ``O_DIRECT`` from the pool's blocks where the folder's file system takes it), through the page cache
(``--no-direct-io``) and with sha256 side by side, in whole tensors (each hashed and tested in one call: fewer
trips through the GIL, each pass a read of memory; the writer's own is 4 MiB, tested from the cache), and with
the NaN/Inf check in a pass of its own over each sample instead of in the write's loop (an earlier release's
way), and with the degenerate-row screen on the engine thread before each put (the previous way: its time is
printed beside the copy's, the engine thread's per step); the cores the process used (CPU time / wall) and
CPU-seconds per GiB; the engine thread's copy per 448 MiB step into pooled blocks and into fresh memory. The
copies run on the torch threads a GPU engine gives them (``DEFAULT_COPY_THREADS``); where torch has more, the
default workers also run with the copies on all of them (the previous release's way), side by side. ``--fp8``
also pushes the same steps stored as FP8 (``--hidden-states-dtype fp8_e4m3``: e4m3 codes and one float32 scale
per row, quantized into the slot as a CPU worker does) through the same path, and prints bytes per token and
GiB/s of *source* (bf16) states.

``--before CHECKOUT`` also runs the writer of another checkout's
``speculators_v016`` (e.g. the previous release: fresh memory per sample, the
NaN check on the engine thread, three fsyncs per sample), in a child process.

    python tools/benchmarks/host_path.py [--gib 2] [--rounds 2] [--workers 1 2 4] [--dir /tmp] [--fp8]
                                         [--before CHECKOUT]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import queue
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

import torch

from speculators_v016 import fp8 as fp8_storage
from speculators_v016.config import DEFAULT_WRITE_WORKERS
from speculators_v016.engine.assembly import Assembler
from speculators_v016.protocol import StepCapture
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.store.writer import SampleWriter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import recording  # noqa: E402

CURRENT = "reject" in inspect.signature(SampleWriter.__init__).parameters  # False: an earlier checkout's writer
CHECKSUMS = "checksum" in inspect.signature(SampleWriter.__init__).parameters
FUSED_CHECK = "non_finite" in inspect.signature(SampleWriter.__init__).parameters  # NaN check in the write loop
WRITER_SCREEN = "screen" in inspect.signature(SampleWriter.__init__).parameters  # degenerate screen on writers
DIRECT = "direct" in inspect.signature(SampleWriter.__init__).parameters  # O_DIRECT writes from placed memory
HELPERS = "shared_blocks" in inspect.signature(SampleWriter.__init__).parameters  # write helper processes
if DIRECT:
    from speculators_v016.store import direct_io
    from speculators_v016.store.sample_format import DATA_ALIGN
if WRITER_SCREEN:
    from speculators_v016.checks.self_check import WriterScreen
sys.path.insert(0, str(Path(__file__).resolve().parent))

if CHECKSUMS:
    from speculators_v016.store import atomic_files, checksum
if CURRENT:
    from speculators_v016.engine.assembly import copy_threads
    from speculators_v016.engine.buffer_pool import BufferPool

    try:  # the check's module alone: no dataset or model libraries on a GPU host without vLLM
        from speculators_v016.checks.finite import non_finite_reason as reject_non_finite
        from speculators_v016.checks.self_check import check_plausible
    except ImportError:  # an earlier checkout
        from speculators_v016.run.pipeline import reject_non_finite

HIDDEN, LAYERS, STEP = 7168, 4, 8192
DTYPE = torch.bfloat16
LAYER_IDS = [2, 30, 57, 60]  # as a 61-layer Kimi-K2.5 run would record them


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def steps(lengths: list[int]):
    """Scheduler-like steps: up to STEP rows each, requests chunked across steps in order.

    Yields ``[(request index, first position, rows), ...]`` per step.
    """
    todo = [[i, 0, n] for i, n in enumerate(lengths)]
    while todo:
        step, room = [], STEP
        while todo and room:
            index, start, left = todo[0]
            rows = min(left, room)
            step.append((index, start, rows))
            room -= rows
            if rows == left:
                todo.pop(0)
            else:
                todo[0] = [index, start + rows, left - rows]
        yield step


def through_writer(
    ring: SlotRing,
    lengths: list[int],
    folder: Path,
    workers: int,
    pool,
    fp8: bool = False,
    threads: str = "engine",
    algorithm: str | None = None,
    chunk: int | None = None,
    own_pass: bool = False,
    screen: str | None = "writer",
    direct: bool = True,
    helpers: bool = False,
) -> dict:
    """Slots -> assembler -> writer -> durable files, as the pipeline runs them; bytes, seconds, CPU, copy time.

    The copies out of the slots run on the torch threads a GPU engine gives them
    (``threads="engine"``) or on all of torch's (``"torch"``, as before). With an
    earlier checkout's writer (``CURRENT`` False): its pipeline's way, fresh
    tensors, the NaN check on this thread, ``put(index, sample)``. ``algorithm``:
    the manifest's digest (None: the writer's default); ``chunk``: the bytes
    written, hashed and tested per call (None: the writer's own, 4 MiB; ``1 << 30``: whole tensors); ``own_pass``:
    the NaN/Inf check reads the sample in a pass of its own before the write (the
    previous release's way), not each chunk from the cache as it is written. ``screen``: the degenerate-row
    screen on the writer's threads (``"writer"``, the run's way where the checkout has it), on this thread
    before each put (``"engine"``, the previous way, timed as the engine thread's), or none (None). ``direct``:
    False writes through the page cache (``--no-direct-io``). ``helpers``: each worker hands its files to a write
    helper process (``pool`` must then be a shared one), as a run does by default.
    """
    options = {"checksum": algorithm} if algorithm else {}
    if CURRENT:
        check = reject_non_finite(LAYER_IDS)
        options.update({"reject": check} if own_pass or not FUSED_CHECK else {"non_finite": check})
        if screen == "writer" and WRITER_SCREEN:
            options["screen"] = WriterScreen(LAYER_IDS)
        if DIRECT:
            options["direct"] = direct
        if helpers:
            options["shared_blocks"] = pool
        writer = SampleWriter(folder, "safetensors", LAYER_IDS, workers=workers, **options)
        if helpers:
            writer.start_helpers()  # before the clock, as a GPU run starts them before its first step
        assembler = Assembler(
            tuple(range(LAYERS)),
            allocate=pool.take if pool else None,
            fp8=fp8,
            copy_threads=copy_threads("cuda") if threads == "engine" else None,
        )
    else:
        writer = SampleWriter(folder, "safetensors", LAYER_IDS, workers=workers)
        assembler = Assembler(tuple(range(LAYERS)))
    for i, n in enumerate(lengths):
        assembler.add_request(f"r{i}", i, n)
    copy = screened = 0.0
    chunk_before = atomic_files.WRITE_CHUNK if CHECKSUMS else None
    if chunk is not None:
        atomic_files.WRITE_CHUNK = chunk
    start, cpu = time.perf_counter(), cpu_seconds()
    try:
        for number, parts in enumerate(steps(lengths), 1):
            slot = ring.acquire()
            rows = sum(p[2] for p in parts)
            capture = StepCapture(
                number, [f"r{i}" for i, _, _ in parts], [s for _, s, _ in parts], [n for _, _, n in parts], slot=slot
            )
            assembler.expect(number, {f"r{i}": (s, n) for i, s, n in parts})
            began = time.perf_counter()
            capture.states = ring.slot(slot)[:, :rows]  # as CaptureEngine._retire does
            if fp8:
                capture.scales = ring.scales(slot)[:, :rows]
            assembler.add(capture)
            copy += time.perf_counter() - began
            ring.release(slot)
            for index, states in assembler.pop_complete():
                n = lengths[index]
                sample = {
                    "input_ids": torch.arange(n, dtype=torch.long),
                    "hidden_states": states,
                    "loss_mask": torch.ones(n, dtype=torch.long),
                }
                if not CURRENT:
                    if any(not torch.isfinite(h).all() for h in states):
                        raise RuntimeError("NaN in synthetic states")
                    writer.put(index, sample)
                else:
                    if screen == "engine":
                        began = time.perf_counter()
                        check_plausible(index, sample["input_ids"], states, LAYER_IDS, False)
                        screened += time.perf_counter() - began
                    blocks = fp8_storage.tensors_of(states)
                    writer.put(index, sample, done=(lambda s=blocks: pool.give_back(s)) if pool else None)
    finally:
        writer.close()
        if chunk_before is not None:
            atomic_files.WRITE_CHUNK = chunk_before
    seconds = time.perf_counter() - start
    if (CURRENT and writer.take_rejected()) or writer.written != len(lengths):
        raise RuntimeError("the writer did not write every sample")
    return {
        "bytes": writer.bytes,
        "seconds": seconds,
        "cpu": cpu_seconds() - cpu + getattr(writer, "helper_cpu", 0.0),  # the helpers' CPU for their files
        "tokens": sum(lengths),
        "copy_ms_per_step": 1e3 * copy * STEP / sum(lengths),
        "screen_ms_per_step": 1e3 * screened * STEP / sum(lengths),
        "commits": writer.commit.commits if CURRENT else len(lengths),
    }


def make_ring(fp8: bool = False) -> SlotRing:
    """Two slots of random bf16 states (``fp8``: quantized into the slot, as a CPU worker's capture does)."""
    ring = SlotRing.create(
        slots=2,
        num_ids=LAYERS,
        max_rows=STEP,
        hidden=HIDDEN,
        dtype=DTYPE,
        shared=False,
        hidden_states_dtype=fp8_storage.NAME if fp8 else "auto",
    )
    for s in range(2):
        for j in range(LAYERS):
            if fp8:
                fp8_storage.quantize_into(torch.randn(STEP, HIDDEN, dtype=DTYPE), ring.slot(s)[j], ring.scales(s)[j])
            else:
                ring.slot(s)[j].normal_()
    return ring


def before(checkout: str, lengths: list[int], folder: Path) -> dict:
    """:func:`through_writer` with ``checkout``'s speculators_v016 and its default workers, in a child process."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(checkout).resolve()), os.environ.get("PYTHONPATH")])),
    }
    args = json.dumps({"lengths": lengths, "folder": str(folder)})
    proc = subprocess.run([sys.executable, __file__, "--child", args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(args: dict) -> None:
    ring = make_ring()
    try:
        print(json.dumps(through_writer(ring, args["lengths"], Path(args["folder"]), DEFAULT_WRITE_WORKERS, None)))
    finally:
        ring.close()


def raw_write(buffers: list[memoryview], folder: Path, streams: int) -> dict:
    """The same bytes, one file each, written and fsynced by ``streams`` threads (no hashing, no rename)."""
    jobs: queue.Queue = queue.Queue()
    for i, b in enumerate(buffers):
        jobs.put((i, b))

    def work():
        while True:
            try:
                i, data = jobs.get_nowait()
            except queue.Empty:
                return
            with open(folder / f"raw_{i}", "wb", buffering=0) as fh:
                view = data
                while view:
                    view = view[fh.write(view) :]
                os.fsync(fh.fileno())

    start, cpu = time.perf_counter(), cpu_seconds()
    threads = [threading.Thread(target=work) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"bytes": sum(len(b) for b in buffers), "seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu}


def raw_direct(buffers: list[memoryview], folder: Path) -> dict:
    """The same bytes, one file each, written with O_DIRECT by one stream (page-aligned ring memory) and fsynced."""
    start, cpu = time.perf_counter(), cpu_seconds()
    for i, data in enumerate(buffers):
        fd = os.open(folder / f"raw_{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if not direct_io.enable(fd):
                raise RuntimeError(f"{folder}: the file system takes no O_DIRECT")
            sink = direct_io.DirectSink(fd)
            sink.write(data)
            sink.finish()
            os.fsync(fd)
        finally:
            os.close(fd)
    return {"bytes": sum(len(b) for b in buffers), "seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu}


def takes_direct(folder: Path) -> bool:
    """This checkout writes with O_DIRECT and the folder's file system takes it."""
    return DIRECT and direct_io.takes(folder)


def hash_alone(buffers: list[memoryview], algorithm: str) -> dict:
    start, cpu = time.perf_counter(), cpu_seconds()
    for b in buffers:
        checksum.of_bytes(b, algorithm)
    return {"bytes": sum(len(b) for b in buffers), "seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu}


def finite_alone(buffers: list[memoryview]) -> dict:
    """The writer's NaN/Inf check of the same bytes, as bf16 states, on this thread."""
    from speculators_v016.checks.finite import (  # noqa: PLC0415 - --before runs this on checkouts without checks/
        all_finite,
    )

    start, cpu = time.perf_counter(), cpu_seconds()
    for b in buffers:
        if not all_finite(torch.frombuffer(b, dtype=DTYPE)):
            raise RuntimeError("NaN in synthetic states")
    return {"bytes": sum(len(b) for b in buffers), "seconds": time.perf_counter() - start, "cpu": cpu_seconds() - cpu}


def clear(folder: Path) -> None:
    for p in folder.iterdir():
        p.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="sample data per measurement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="folder on the disk to measure (a temp folder inside)")
    ap.add_argument("--fresh", action="store_true", help="also the default workers without the buffer pool")
    ap.add_argument("--fp8", action="store_true", help="also FP8 storage (codes + scales), default workers")
    ap.add_argument(
        "--before",
        default=None,
        metavar="CHECKOUT",
        help="also the writer of this checkout's speculators_v016 (default workers), in a child process",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        return child(json.loads(opts.child))
    workers = sorted(set(opts.workers) | {DEFAULT_WRITE_WORKERS})
    rng = random.Random(0)
    lengths, total = [], 0
    while total < opts.gib * 2**30:
        lengths.append(rng.randint(1536, 2560))
        total += lengths[-1] * LAYERS * HIDDEN * DTYPE.itemsize
    ring = make_ring()
    fp8_ring = make_ring(fp8=True) if opts.fp8 else None
    raw_bytes = ring.buffer.view(-1).view(torch.uint8).numpy()
    size = LAYERS * HIDDEN * DTYPE.itemsize
    buffers, offset = [], 0
    for n in lengths:  # the raw baselines write and hash the same number of bytes per file
        if offset + n * size > raw_bytes.size:
            offset = 0
        buffers.append(memoryview(raw_bytes[offset : offset + n * size]))
        offset += n * size
    pool = BufferPool(align=DATA_ALIGN) if DIRECT else BufferPool()  # placed as the run's pool places samples
    runs: dict[str, list[dict]] = {}
    base = Path(tempfile.mkdtemp(prefix="host-path-", dir=opts.dir))
    try:
        configs = [
            ("raw write+fsync, 1 stream", lambda: raw_write(buffers, base, 1)),
            (f"raw write+fsync, {max(workers)} streams", lambda: raw_write(buffers, base, max(workers))),
            *(
                [("raw write+fsync, O_DIRECT, 1 stream", lambda: raw_direct(buffers, base))]
                if takes_direct(base)
                else []
            ),
            ("blake3 alone, 1 thread", lambda: hash_alone(buffers, "blake3")),
            ("sha256 alone, 1 thread", lambda: hash_alone(buffers, "sha256")),
            ("NaN/Inf check alone, 1 thread", lambda: finite_alone(buffers)),
        ]
        configs += [
            (
                f"writer, {w} worker(s), blake3",
                lambda w=w: through_writer(ring, lengths, base, w, pool, algorithm="blake3"),
            )
            for w in workers
        ]
        if HELPERS:
            shared_pool = BufferPool(align=DATA_ALIGN, shared=True)
            configs += [
                (
                    f"writer, {w} worker(s), blake3, write helpers",
                    lambda w=w: through_writer(ring, lengths, base, w, shared_pool, helpers=True),
                )
                for w in workers
            ]
        if DIRECT:
            configs.append(
                (
                    f"writer, {DEFAULT_WRITE_WORKERS} worker(s), blake3, page cache",
                    lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, direct=False),
                )
            )
        configs += [
            (
                f"writer, {DEFAULT_WRITE_WORKERS} worker(s), sha256",
                lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, algorithm="sha256"),
            ),
            (
                f"writer, {DEFAULT_WRITE_WORKERS} worker(s), blake3, whole tensors",
                lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, chunk=1 << 30),
            ),
        ]
        if WRITER_SCREEN:
            configs.append(
                (
                    f"writer, {DEFAULT_WRITE_WORKERS} worker(s), blake3, screen on the engine thread",
                    lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, screen="engine"),
                )
            )
        if FUSED_CHECK:
            configs.append(
                (
                    f"writer, {DEFAULT_WRITE_WORKERS} worker(s), blake3, NaN check in its own pass",
                    lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, own_pass=True),
                )
            )
        if opts.before:
            configs.append(("before: writer, its default workers", lambda: before(opts.before, lengths, base)))
        through_writer(ring, lengths[: len(lengths) // 2], base, max(workers), pool)  # warm the pool: a long run's
        clear(base)  # steady state
        if HELPERS:
            through_writer(ring, lengths[: len(lengths) // 2], base, max(workers), shared_pool, helpers=True)
            clear(base)
        if fp8_ring is not None:
            configs.append(
                (
                    f"fp8: writer, {DEFAULT_WRITE_WORKERS} worker(s)",
                    lambda: through_writer(fp8_ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, fp8=True),
                )
            )
            through_writer(fp8_ring, lengths[: max(1, len(lengths) // 4)], base, DEFAULT_WRITE_WORKERS, pool, fp8=True)
            clear(base)
        if copy_threads("cuda") != torch.get_num_threads():
            configs.append(
                (
                    f"writer, {DEFAULT_WRITE_WORKERS} worker(s), copy on {torch.get_num_threads()} threads",
                    lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, pool, threads="torch"),
                )
            )
        if opts.fresh:
            configs.append(
                (
                    f"writer, {DEFAULT_WRITE_WORKERS} worker(s), fresh memory",
                    lambda: through_writer(ring, lengths, base, DEFAULT_WRITE_WORKERS, None),
                )
            )
        for _ in range(opts.rounds):
            for name, run in configs:
                runs.setdefault(name, []).append(run())
                clear(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        ring.close()
        if fp8_ring is not None:
            fp8_ring.close()
    rate = {k: statistics.median(r["bytes"] / r["seconds"] / 2**30 for r in v) for k, v in runs.items()}
    cores = {k: statistics.median(r["cpu"] / r["seconds"] for r in v) for k, v in runs.items()}
    per_gib = {k: statistics.median(r["cpu"] / (r["bytes"] / 2**30) for r in v) for k, v in runs.items()}
    out = []
    out.append(
        f"{len(lengths)} samples of 1536-2560 tokens x {LAYERS} layers x {HIDDEN} bf16 "
        f"({total / 2**30:.2f} GiB) per measurement, steps of {STEP} tokens, folder on {opts.dir}, "
        f"{os.cpu_count()} CPUs, {opts.rounds} round(s), medians"
    )
    raw1 = rate["raw write+fsync, 1 stream"]
    for name in runs:
        extra = ""
        if "writer" in name:
            copy = statistics.median(r["copy_ms_per_step"] for r in runs[name])
            screened = statistics.median(r.get("screen_ms_per_step", 0.0) for r in runs[name])
            commits = statistics.median(r["commits"] for r in runs[name])
            per_token = statistics.median(r["bytes"] / r["tokens"] for r in runs[name])
            source = statistics.median(
                r["tokens"] * LAYERS * HIDDEN * DTYPE.itemsize / r["seconds"] / 2**30 for r in runs[name]
            )
            extra = (
                f"  {rate[name] / raw1:.2f}x raw 1 stream; {per_token / 1024:.1f} KiB/token on disk, "
                f"{source:.2f} GiB/s of bf16 states; engine thread: copy {copy:.0f} ms"
                f"{f' + screen {screened:.0f} ms' if screened else ''} per step; "
                f"{commits:.0f} commits for {len(lengths)} samples"
            )
        out.append(
            f"  {name:56} {rate[name]:6.2f} GiB/s  {cores[name]:4.2f} cores  {per_gib[name]:5.2f} CPU-s/GiB{extra}"
        )
    out.append(f"  pool: {pool.allocated} blocks made, {pool.reused} reuses")
    with recording(__file__):
        print("\n".join(out))


if __name__ == "__main__":
    main()
