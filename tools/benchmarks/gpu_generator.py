#!/usr/bin/env python3
"""The generator on vLLM's GPU loop against vLLM's own loop, side by side, and the CLI writing files against it.

Sides, each a process of its own holding its engine warm for the whole run (compiled, CUDA graphs, bf16):

* ``vllm``: vLLM's own loop, ``LLMEngine`` (add_request, then step until done; max_tokens=1), its engine
  core in a process of its own as vLLM runs it;
* ``uni``: the generator (``stream()``, 4 layers captured, states dropped as a writer would take them),
  the worker in the driving process (the uniprocess executor, the default on one GPU);
* ``mp``: the same with the multiprocess executor (TP 1: the worker in a process of its own);
* ``vllm-aux`` (asked for by name): vLLM's own loop as ``vllm``, its model computing the capture's aux states
  (vLLM's built-in ids and our taps, installed as the generator installs them) that nothing copies and vLLM's
  runner drops (``aux_only.py``): ``vllm-aux / vllm`` is the capture's arithmetic, ``uni / vllm-aux`` the rest.

Shapes: a few layers of a Llama at hidden 256 (a trial), 4096 and 7168; and ``kimi``, a 3-layer slice of
Kimi-K2.5's real geometry (:mod:`speculators_v016.testing.kimi_slice`: hidden 7168, MLA with YaRN, a dense
first layer, 2 MoE layers of 384 routed experts in its INT4 W4A16 format, vocabulary 163,840; ~25 GB
written once under ``--where``), prompts of 1k-8k tokens by default, every layer captured, MLA with
``TRITON_MLA`` and the GPU kit's stand-ins (:mod:`speculators_v016.testing.gpu_kit`) in every process of
every side (vLLM's own loop included; a full vLLM build keeps its compiled kernels). The generator's sides
print the capture ring (host memory, registered as pinned memory by the output worker) and the GPU
staging buffers.

``--before CHECKOUT`` adds the side ``uni-before``: ``uni`` with the package of another checkout (its
``speculators_v016`` first on the side's path; its ready line names the package it imported), timed in the same
rounds, so that a change's effect on the generator is measured side by side (``uni / uni-before``).

Each round times one pass of every side over the same prompts, in turn (interleaved: the machine's noise
hits all alike); ratios are of medians. ``--cli`` also times ``speculators-data-gen`` writing the files
(its own summary line: tokens/s from the first step to the last file made durable, the writers drained)
against the ``uni`` side's passes over the same prompts (``--cli-consume``: a consumer deletes each file once
listed, so the CLI writes the sides' own prompts through a folder in RAM; ``--cli-prompts N``: uni also times a
pass over the CLI's N each round). ``--profile`` runs one pass of the generator under torch's profiler and
gives the share of GPU time in our copies (device-to-device into the staging buffer, device-to-host into the
ring) and in FP8 quantization, and the device's idle time in that pass (gaps with no kernel and no copy but
those to the host: a step waiting on the host shows as one).

    . .gpu-vllm/install.sh && python3 tools/benchmarks/gpu_generator.py [--shapes 4096 7168] [--rounds 3] [--cli]
    . .gpu-vllm/install.sh && python3 tools/benchmarks/gpu_generator.py --shapes kimi --sides vllm uni --prompts 64
    # kimi: two sides need an H200; on an 80 GB H100 the second side's expert layout ran out of memory (2026-12-07),
    # so there one side a process, alternately: --sides vllm --memory 0.6, then --sides uni --memory 0.6
    # (not side by side)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import stat
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kept_side import Side  # noqa: E402
from report import recording  # noqa: E402

#: shape -> the bench model: by hidden size, a few layers of a Llama, the vocabulary of the targets of that width;
#: ``kimi``: the Kimi-K2.5 slice (its own builder), longer prompts, more of the GPU a side, MLA and the kit's stand-ins.
SHAPES = {
    256: dict(layers=4, vocab=1024, intermediate=512, heads=4, kv_heads=2),  # a trial of the script (CPU too)
    4096: dict(layers=8, vocab=32000, intermediate=14336, heads=32, kv_heads=8),
    7168: dict(layers=4, vocab=129280, intermediate=7168, heads=56, kv_heads=8),
    "kimi": dict(layers=3, vocab=163840, intermediate=18432, hidden=7168, high=8192, memory=0.4, kimi=True),
}
#: set for a side's processes that need the GPU kit's stand-ins (vLLM's spawned processes read it: see the end)
STAND_INS = "SPECULATORS_BENCH_STAND_INS"
#: engine settings that are the generator's own keywords (the rest go through extra_engine_args)
OURS = ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "enforce_eager")
CAPTURE = 4  # layers captured: 1, n//2, n-2, n-1 of the bench model
#: the generator's engine stats reported for each timed pass (speculators_v016.engine.core.EngineStats)
STREAM_STATS = ("stepped", "drained", "copy_thread", "copy_waited", "prefault_hits", "prefault_misses")
TRACE_PROMPTS = 48  # --profile-trace: prompts of the traced pass (~15 steps; its trace a few MB gzipped)


def shape_key(text: str):
    """``--shapes`` value -> a key of :data:`SHAPES` (hidden sizes are ints)."""
    return int(text) if text.isdigit() else text


def bench_model(where: Path, hidden) -> str:
    """A random-weight Llama of ``hidden`` (built once, bf16, no tokenizer needed: prompts are token ids), or for
    ``kimi`` the Kimi-K2.5 slice (built once, on the GPU; reused while its config.json is there)."""
    if hidden == "kimi":
        from speculators_v016.testing.kimi_slice import build_kimi_slice  # noqa: PLC0415 - parent only

        folder = Path(where) / "kimi-slice"
        if not (folder / "config.json").exists():
            build_kimi_slice(folder, SHAPES["kimi"]["layers"], progress=lambda line: print(line, file=sys.stderr))
        return str(folder)
    from speculators_v016.testing.tiny_models import build_tiny_model  # noqa: PLC0415 - transformers, parent only

    s = SHAPES[hidden]
    where = Path(where) / f"llama-{hidden}"
    if not (where / "config.json").exists():
        build_tiny_model(where, "llama", num_layers=s["layers"], hidden_size=hidden, intermediate_size=s["intermediate"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], model_vocab_size=s["vocab"],
                         head_dim=hidden // s["heads"], max_position_embeddings=8192, dtype="bfloat16")  # fmt: skip
    return str(where)


def prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch  # noqa: PLC0415 - only where prompts are made

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(5, vocab - 5, (n,), generator=gen).tolist() for n in lengths]


def engine_settings(args: dict) -> dict:
    extra = json.loads(os.environ.get("SPECULATORS_GPU_ENGINE_ARGS") or "{}")
    if args.get("kimi"):  # MLA: vLLM's MLA kernels (Triton) instead of the kit's default attention backend
        extra["attention_config"] = {**extra.get("attention_config", {}), "backend": "TRITON_MLA"}
    return dict(dtype="bfloat16", max_model_len=args["high"] + 8, max_num_seqs=args["max_num_seqs"], enforce_eager=args["eager"],
                max_num_batched_tokens=args["batched_tokens"], gpu_memory_utilization=args["memory"], **extra)  # fmt: skip


def layer_ids(num_layers: int) -> list[int]:
    """Four layers as a run of a deep target records them; a model of at most 4 layers: all of them."""
    return (
        list(range(num_layers))
        if num_layers <= CAPTURE
        else sorted({1, num_layers // 2, num_layers - 2, num_layers - 1})
    )


# -- a side: a child process that holds its engine and times a pass on each "run" line ------------------------
def side(args: dict) -> None:
    batch = prompts(args["count"], args["low"], args["high"], args["vocab"])
    warm = prompts(8, args["low"], args["high"], args["vocab"], seed=1)
    # "run cli": a pass over the prompts the CLI writes, where they are not the side's own (--cli-prompts)
    theirs = args.get("cli_count") if args["side"] == "uni" else None
    cli_batch = prompts(theirs, args["low"], args["high"], args["vocab"]) if theirs else None
    settings = engine_settings(args)
    if args.get("kimi"):  # before any engine: this process sees the stand-ins, and vLLM's engine core runs in it
        from speculators_v016.testing import gpu_kit  # noqa: PLC0415 - the GPU kit's stand-ins, kimi only

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # a spawned core would not have them (as ours, in-process)
        gpu_kit.install()
    memory, engine_stats = None, lambda: {}
    if args["side"] in ("vllm", "vllm-aux"):
        from vllm import SamplingParams  # noqa: PLC0415 - each side imports what it measures
        from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - the same
        from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 - the same

        if args["side"] == "vllm-aux":  # vLLM's loop, its model computing the capture's aux states (aux_only.py)
            import aux_only  # noqa: PLC0415 - this side only: it imports vLLM's executor

            from speculators_v016.engine.engine_args import EXTENSION  # noqa: PLC0415 - the same
            from speculators_v016.layers import LayerPlan  # noqa: PLC0415 - the same

            plan = LayerPlan.build(args["layers"], layer_ids(args["layers"]))
            os.environ[aux_only.IDS_VARIABLE] = json.dumps(list(plan.capture_ids))  # before the engine core starts
            engine_args = EngineArgs(model=args["model"], enable_prefix_caching=False, worker_extension_cls=EXTENSION,
                                     additional_config={"speculators_v016": aux_only.capture_config().as_dict()},
                                     **settings)  # fmt: skip
            # The executor class handed to the engine, its backend left to vLLM ("uni", as for the vllm side): a
            # class as distributed_executor_backend turns vLLM 0.16's async scheduling off.
            engine = aux_only.engine(engine_args)
        else:
            engine = LLMEngine.from_engine_args(
                EngineArgs(model=args["model"], enable_prefix_caching=False, **settings)
            )
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async_scheduling = bool(engine.vllm_config.scheduler_config.async_scheduling)

        def one_pass(items):
            for i, ids in enumerate(items):
                engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                engine.step()
    else:
        from speculators_v016.generator import VllmHiddenStatesGenerator  # noqa: PLC0415 - the same

        extra = {k: settings.pop(k) for k in list(settings) if k not in OURS}
        executor = "uni" if args["side"] == "uni-before" else args["side"]  # the same, another checkout's package
        gen = VllmHiddenStatesGenerator(args["model"], layer_ids=layer_ids(args["layers"]), executor=executor,
                                        extra_engine_args=extra, **settings)  # fmt: skip

        def one_pass(items):
            for _ in gen.stream(items):  # dropped, as a writer takes them
                pass

        def engine_stats() -> dict:
            stats = gen.engine.stats
            return {name: getattr(stats, name) for name in STREAM_STATS if hasattr(stats, name)}  # older: fewer

        async_scheduling = bool(gen.engine.async_scheduling)
        ring, info = gen.engine.ring, gen.engine.capture_info[0]
        memory = {
            "copy_path": info.get("copy_path"),
            "staging": info.get("staging") or {},
            "in_place": info.get("staging_in_place"),  # an experiment's set-up line, where a --before checkout has it
            "ring": "none",
            "ring_bytes": 0,
        }
        if ring is not None:
            memory.update(ring=ring.spec.describe(), ring_bytes=ring.spec.total_bytes)

    one_pass(warm)
    import speculators_v016  # noqa: PLC0415 - which checkout's package this side runs (--before)

    print(json.dumps({"ready": True, "memory": memory, "async_scheduling": async_scheduling,
                      "package": str(Path(speculators_v016.__file__).resolve().parent)}), flush=True)  # fmt: skip
    for line in sys.stdin:
        if line.strip() == "profile":
            print(json.dumps(profile(one_pass, batch)), flush=True)
            continue
        if line.startswith("trace "):  # trace PATH: a shorter pass, the host's ops too, for trace_gaps
            print(json.dumps(trace(one_pass, batch[:TRACE_PROMPTS], Path(line[6:].strip()))), flush=True)
            continue
        items = cli_batch if line.strip() == "run cli" and cli_batch is not None else batch
        before = engine_stats()
        start = time.perf_counter()
        one_pass(items)
        seconds = time.perf_counter() - start
        after = engine_stats()
        print(json.dumps({"tokens_per_s": sum(map(len, items)) / seconds, "seconds": seconds,
                          "stream": {k: after[k] - before[k] for k in after}}), flush=True)  # fmt: skip


def profile(one_pass, batch) -> dict:
    """One pass under torch's profiler: GPU time by kind of kernel (our copies and quantizer apart)."""
    import torch  # noqa: PLC0415 - the child has it loaded already
    from torch.profiler import ProfilerActivity  # noqa: PLC0415 - the same

    gpu = torch.cuda.is_available()  # a CPU trial of the script: no device events
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        one_pass(batch)
        if gpu:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    kinds: dict[str, float] = {}
    spans: list[tuple[float, float]] = []  # (start, end) in µs of every device event but the device-to-host copies
    for event in prof.events():
        us = getattr(event, "device_time", 0.0) or getattr(event, "cuda_time", 0.0) or 0.0
        if not us:
            continue
        name = event.name
        kind = ("memcpy DtoH" if "DtoH" in name or "Device -> Pageable" in name or "Device -> Pinned" in name
                else "memcpy DtoD" if "DtoD" in name or "Device -> Device" in name
                else "memcpy HtoD" if "HtoD" in name or "-> Device" in name
                else "fp8 quantize" if "quantize" in name.lower() else "compute")  # fmt: skip
        kinds[kind] = kinds.get(kind, 0.0) + us
        span = getattr(event, "time_range", None)
        if kind != "memcpy DtoH" and "cuda" in str(getattr(event, "device_type", "")).lower() and span is not None:
            spans.append((span.start, span.end))
    total = sum(kinds.values()) or 1.0
    return {"gpu_ms": {k: v / 1e3 for k, v in kinds.items()}, "share": {k: v / total for k, v in kinds.items()},
            "wall_ms": wall_ms, "compute_busy": kinds.get("compute", 0.0) / 1e3 / wall_ms,
            "idle": idle_gaps(spans)}  # fmt: skip


def trace(one_pass, batch, path: Path) -> dict:
    """One pass of ``batch`` under torch's profiler with the host's ops and CUDA calls too (no Python stacks: their
    cost would make every gap the host's), its Chrome trace gzipped at ``path``, and trace_gaps' report of it."""
    import gzip  # noqa: PLC0415 - only here
    import shutil  # noqa: PLC0415 - the same

    import torch  # noqa: PLC0415 - the child has it loaded already
    from torch.profiler import ProfilerActivity  # noqa: PLC0415 - the same
    from trace_gaps import describe, gap_report, load  # noqa: PLC0415 - the same

    path.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()  # a CPU trial of the script: the host's ops alone
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        one_pass(batch)
        if gpu:
            torch.cuda.synchronize()
    raw = path.with_suffix("")  # PATH is NAME.json.gz
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    report = gap_report(load(raw))
    raw.unlink()
    return {"report": report, "text": describe(report), "path": str(path), "prompts": len(batch)}


def idle_gaps(spans: list[tuple[float, float]]) -> dict:
    """Where the device ran nothing but the copies to the host, between its first and last event (µs spans):
    the time in gaps, and in gaps of at least 0.1 ms and 1 ms (a step's boundary shows as one of those)."""
    if not spans:
        return {}
    spans = sorted(spans)
    gaps, end = [], spans[0][1]
    for start, stop in spans[1:]:
        if start > end:
            gaps.append(start - end)
        end = max(end, stop)
    window = end - spans[0][0]
    over = {f"{limit}ms": [g for g in gaps if g >= limit * 1e3] for limit in (0.1, 1)}
    return {"window_ms": window / 1e3, "idle_ms": sum(gaps) / 1e3, "events": len(spans),
            **{f"gaps_{k}": len(v) for k, v in over.items()},
            **{f"idle_in_gaps_{k}_ms": sum(v) / 1e3 for k, v in over.items()},
            "largest_gap_ms": max(gaps, default=0.0) / 1e3}  # fmt: skip


def side_py_spy(running: Side, path: Path) -> None:
    """One more pass of a side while py-spy samples it and its children without pausing them (not timed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(running.proc.pid), "--subprocesses", "--nonblocking",
                            "--threads", "--idle", "--rate", "200", "--format", "speedscope", "--output", str(path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(1.0)  # py-spy attached
    rate = running.ask()["tokens_per_s"]
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
    subprocess.run(["gzip", "-f", str(path)], check=False)
    print(f"py-spy of side {running.name}: {path}.gz ({rate:,.0f} tokens/s while sampled)", file=sys.stderr, flush=True)


def checkout_commit(folder: Path) -> str:
    """``commit abc1234`` (``, with local changes`` where its tree differs) of the git checkout ``folder``, or what
    it is not."""
    head = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "not a git checkout: its commit unknown"
    dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain"], capture_output=True, text=True)
    return f"commit {head.stdout.strip()}" + (", with local changes" if dirty.stdout.strip() else "")


def start_side(args: dict, before: Path | None = None) -> Side:
    """A running side, started: ask it for passes (its ready line says its memory); ``uni-before`` with the package
    of the checkout ``before`` first on its path, refused unless it imported that one."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **({STAND_INS: "1"} if args.get("kimi") else {})}
    if args["side"] == "uni-before":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before), env.get("PYTHONPATH")]))
    running = Side(__file__, args, env)
    wanted = (before / "speculators_v016").resolve() if args["side"] == "uni-before" else None
    if wanted is not None and running.ready.get("package") != str(wanted):
        running.close()
        raise SystemExit(f"side uni-before imported {running.ready.get('package')}, not {wanted} (--before)")
    return running


def write_rate(folder: Path, gib: int = 4) -> float:
    """GiB/s of one thread writing ``gib`` GiB into ``folder`` in 64 MiB pieces, fsync'd: what the disk takes."""
    folder.mkdir(parents=True, exist_ok=True)
    piece, path = os.urandom(64 << 20), folder / "write-rate.bin"
    start = time.perf_counter()
    with open(path, "xb") as f:  # made here, never over another's file: the unlink below removes only ours
        for _ in range(gib * 16):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return gib / seconds


def writers_rate(folder: Path, threads: int, gib_each: int = 2) -> float:
    """GiB/s that ``threads`` threads together hash (BLAKE3) and write into ``folder``, each its own file of
    ``gib_each`` GiB in the writers' chunks (``store/atomic_files.py``'s ``WRITE_CHUNK``), fsync'd: the ceiling of
    that many write workers on this host, beside nothing else (no NaN/Inf test: the device proves a GPU's steps)."""
    import blake3  # noqa: PLC0415 - the CLI's dependency; this script's parent needs it here only

    from speculators_v016.store.atomic_files import WRITE_CHUNK  # noqa: PLC0415 - parent only

    folder.mkdir(parents=True, exist_ok=True)
    piece = memoryview(os.urandom(64 << 20))
    made: list[tuple[Path, object]] = []  # files this call created (exclusively): the only ones it unlinks
    try:
        for i in range(threads):
            path = folder / f"writers-rate-{i}.bin"
            made.append((path, open(path, "xb", buffering=0)))  # noqa: SIM115 - closed below

        def write(f) -> None:
            digest = blake3.blake3()
            for _ in range(gib_each * 16):
                for start in range(0, len(piece), WRITE_CHUNK):
                    chunk = piece[start : start + WRITE_CHUNK]
                    f.write(chunk)
                    digest.update(chunk)
            os.fsync(f.fileno())

        workers = [threading.Thread(target=write, args=(f,)) for _, f in made]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        seconds = time.perf_counter() - start
    finally:
        for path, f in made:
            f.close()
            path.unlink()
    return threads * gib_each / seconds


class Consumer(threading.Thread):
    """Deletes each sample file of the CLI's folder ``out`` once its manifest lists it, as the online mode's trainer
    deletes what it read (``--cli-consume``): a run as long as the sides' passes then fits in a folder in RAM.
    Only names of sample files (``data_N.ext``, no folder), regular files (never a link), in ``out`` itself; it runs
    at nice 10 and counts its files, bytes and CPU seconds."""

    def __init__(self, out: Path):
        super().__init__(name="bench-consumer", daemon=True)
        self.out, self.files, self.bytes, self.cpu = out, 0, 0, 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        from speculators_v016.store.sample_format import parse_sample_name  # noqa: PLC0415 - parent only

        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        manifest, offset, last = self.out / "manifest.jsonl", 0, False
        while not last:
            last = self.stop.is_set()  # one more read after the CLI ended: its last lines
            try:
                with open(manifest, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                data = b""
            lines = data[: data.rfind(b"\n") + 1]  # whole lines only; the rest is read again
            offset += len(lines)
            for line in lines.splitlines():
                name = json.loads(line).get("file", "")
                path = self.out / name
                if parse_sample_name(name) is None or path.name != name:
                    continue
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    path.unlink()
                    self.files, self.bytes = self.files + 1, self.bytes + info.st_size
            if not last:
                self.stop.wait(0.02)
        self.cpu = time.thread_time()

    def line(self) -> str:
        return (f"; the benchmark's consumer deleted {self.files} files ({self.bytes / 2**30:.1f} GiB) as the manifest "
                f"listed them, on {self.cpu:.1f} CPU-s (nice 10)")  # fmt: skip


def cli_rate(
    model: str,
    data: Path,
    out: Path,
    args: dict,
    workers: int | None = None,
    dtype: str = "auto",
    py_spy: Path | None = None,
    switch: float | None = None,
    chunk: int | None = None,
    helpers: str | None = None,
    finite: bool = True,
    direct: str = "auto",
    consume: bool = False,
    copy: int | None = None,
    place: bool | None = None,
) -> tuple[float, str]:
    """speculators-data-gen writing every sample (default options, the GPU build's engine arguments): its
    tokens/s from the first step to the last file made durable (the writers drained), from the summary, and
    its summary's ``host path`` line. ``py_spy``: run it under ``py-spy record`` (every thread, waiting included,
    sampled without pausing the process), the profile written there as speedscope JSON (not a figure). ``switch``:
    the CLI's process runs with this GIL switch interval (``sys.setswitchinterval``, seconds; None: Python's 5 ms):
    a writer thread's every C call waits up to one interval for the GIL beside the engine thread's Python.
    ``chunk``: the writers hash and test this many bytes a call (``store/atomic_files.py``'s ``WRITE_CHUNK``;
    None: its own). ``helpers``: its ``--write-helpers`` (None: its default, off). ``finite=False``: a measurement
    only, no setting of the CLI: its writers skip the NaN/Inf test of each chunk (what moving the test off the host's
    cores would save them at most). ``direct``: ``auto`` (the CLI's default: O_DIRECT where the file
    system takes it, buffered on tmpfs and ramfs), ``off`` (its ``--no-direct-io``) or ``always`` (O_DIRECT on tmpfs
    too, as before 2026-12-06: ``direct_io.in_memory`` answers None in its process; a measurement only).
    ``copy``: torch's threads for the copies out of the ring slots (``config.DEFAULT_COPY_THREADS``, 4; a
    measurement only). ``place``: True, the worker copies each prompt's rows straight into its pinned block
    (``engine.core.PLACE_ROWS``, the default), False: through the ring slot (a measurement only). ``consume``: a :class:`Consumer` deletes each file once it is
    listed (its figures end the host line)."""
    if out.exists():  # removed after the run below: only a folder this call's CLI made
        raise RuntimeError(f"{out} exists already: the benchmark removes only the CLI folder it makes; move it away")
    settings = engine_settings(args)
    extra = {k: v for k, v in settings.items() if k not in OURS}
    module = "speculators_v016.testing.gpu_kit" if args.get("kimi") else "speculators_v016.run.cli"  # kimi: stand-ins
    setup = (
        ([f"sys.setswitchinterval({switch!r})"] if switch is not None else [])
        + ([f"import speculators_v016.store.atomic_files as a; a.WRITE_CHUNK = {chunk}"] if chunk is not None else [])
        + (
            [f"import speculators_v016.engine.assembly as c; c.DEFAULT_COPY_THREADS = {copy}"]
            if copy is not None
            else []
        )
        + ([] if place is None else [f"import speculators_v016.engine.core as e; e.PLACE_ROWS = {place!r}"])
        + ([] if finite else ["import speculators_v016.store.writer as w; w._finite_scan = lambda dtype: None"])
        + (
            ["import speculators_v016.store.direct_io as d; d.in_memory = lambda folder: None"]
            if direct == "always"
            else []
        )
    )
    run_module = f"runpy.run_module({module!r}, run_name='__main__')"
    start = ["-c", "; ".join(["import runpy, sys", *setup, run_module])] if setup else ["-m", module]
    cmd = [sys.executable, *start, "--target-model-path", model, "--train-data-path",
           str(data), "--output-dir", str(out), "--seq-length", str(args["high"]), "--layer-ids",
           ",".join(map(str, layer_ids(args["layers"]))), "--engine-args", json.dumps(extra),
           "--gpu-memory-utilization", str(args["memory"]), "--max-num-seqs", str(args["max_num_seqs"]),
           "--max-num-batched-tokens", str(args["batched_tokens"]), "--token-freq-path", "", "--logit-check-samples",
           "0", "--no-progress", *(["--enforce-eager"] if args["eager"] else []),
           "--hidden-states-dtype", dtype, *(["--write-workers", str(workers)] if workers else []),
           *(["--write-helpers", helpers] if helpers else []), *(["--no-direct-io"] if direct == "off" else []),
           *(["--ignore-disk-forecast"] if consume else [])]  # fmt: skip
    if py_spy is not None:
        py_spy.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["py-spy", "record", "--threads", "--idle", "--nonblocking", "--rate", "100", "--format", "speedscope",
               "--output", str(py_spy), "--", *cmd]  # fmt: skip
    consumer = Consumer(out) if consume else None
    if consumer is not None:
        consumer.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        if consumer is not None:
            consumer.stop.set()
            consumer.join()
    print(f"CLI, {workers or 'default'} write workers, under {out.parent}:\n{proc.stdout[-2500:]}", file=sys.stderr)
    stepped = engine_stepped(out)
    subprocess.run(["rm", "-rf", str(out)], check=False)
    found = re.search(r"\(([\d,]+) tokens/s", proc.stdout + proc.stderr)
    if consumer is not None and proc.returncode == 1 and consumed_only(proc.stdout + proc.stderr, consumer.files):
        proc.returncode = 0  # its verify found missing exactly the files the consumer deleted, and nothing else
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"the CLI failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    host = re.search(r"host path:\s+(.*)", proc.stdout + proc.stderr)
    line = host.group(1).strip() if host else ""
    line += f"; in vLLM's steps {stepped:.3f} s (data_config.json)" if stepped is not None else ""
    return float(found.group(1).replace(",", "")), line + (consumer.line() if consumer is not None else "")


def engine_stepped(out: Path) -> float | None:
    """The seconds the CLI's engine thread spent in vLLM's steps, to the ms (its folder's ``data_config.json``,
    the run's summary: the summary line rounds them to 0.1 s); None where it has none."""
    try:
        config = json.loads((out / "data_config.json").read_text())
        return float(config["speculators_v016"]["last_run"]["host"]["engine_stepped"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def consumed_only(text: str, deleted: int) -> bool:
    """The CLI's output (exit 1, ``--cli-consume``): does its verify line fail only for the files a consumer deleted,
    every sample it wrote (``written``) and every problem it names a listed file that is missing?"""
    written = re.search(r"written:\s+(\d+) samples", text)
    problems = [x.strip() for x in text.splitlines() if x.startswith("  ") and ": " in x and "/data_" in x]
    return (
        bool(written)
        and int(written.group(1)) == deleted
        and re.search(r"^verify:\s+FAILED", text, re.MULTILINE) is not None
        and all(x.endswith(": listed in the manifest but missing") for x in problems)
        and not re.search(r"^(error|Error)", text, re.MULTILINE)
    )


def where_time(steady: tuple[float, float], host: str, tokens: int, passes: list[dict]) -> str:
    """The CLI's seconds to the engine's last sample against uni's pass over the same prompts (medians), each split
    into the engine's thread's time in vLLM's steps and the rest (its summary's ``host path`` line; uni's
    EngineStats): where the CLI's extra time goes, before its tail."""
    stepped = re.search(r"in vLLM's steps ([\d.]+) s \(data_config.json\)", host) or re.search(
        r"spent ([\d.]+) s in vLLM's steps", host
    )
    uni_s = statistics.median(tokens / x["tokens_per_s"] for x in passes)
    uni_stepped = [x["stream"]["stepped"] for x in passes if "stepped" in (x.get("stream") or {})]
    cli_s = tokens / steady[0]
    if not stepped or not uni_stepped:
        return f"seconds to the engine's last sample: CLI {cli_s:.2f}, uni {uni_s:.2f}"
    uni_in = statistics.median(uni_stepped)
    cli_in = float(stepped.group(1))
    return (
        f"seconds to the engine's last sample: CLI {cli_s:.2f} ({cli_in:.2f} in vLLM's steps, "
        f"{cli_s - cli_in:.2f} outside), uni {uni_s:.2f} ({uni_in:.2f} in vLLM's steps, {uni_s - uni_in:.2f} outside)"
    )


def to_last_sample(rate: float, host: str, tokens: int) -> tuple[float, float] | None:
    """The CLI's tokens/s to the engine's last sample (its clock less the tail its summary's ``host path`` line
    names: the last files made durable after that sample) and the tail's seconds; None where the line has none."""
    tail = re.search(r"made durable ([\d.]+) s after the engine's last sample", host)
    if not tail or rate <= 0:
        return None
    seconds = tokens / rate
    return tokens / max(seconds - float(tail.group(1)), 1e-9), float(tail.group(1))


ON_OFF = {"on": True, "off": False}
VARIANT_KEYS = {
    "switch": float,
    "chunk": int,
    "workers": int,
    "copy": int,
    "place": ON_OFF.__getitem__,
    "finite": ON_OFF.__getitem__,
    "direct": {"auto": "auto", "off": "off", "always": "always"}.__getitem__,
}


def cli_variant(text: str) -> dict:
    """``--cli-variants``' SPEC: ``key=value`` pairs, comma-separated, of :data:`VARIANT_KEYS` (e.g.
    ``switch=0.0002,workers=12``; ``place=off``: rows through the ring slot, a measurement only; ``finite=off``: the writers skip the NaN/Inf test, a measurement only;
    ``direct=off``: the CLI's ``--no-direct-io``; ``direct=always``: O_DIRECT on tmpfs too, a measurement only)."""
    spec = {}
    for pair in text.split(","):
        key, _, value = pair.partition("=")
        if key not in VARIANT_KEYS:
            raise argparse.ArgumentTypeError(f"{text!r}: {key!r} is not one of {', '.join(VARIANT_KEYS)}")
        try:
            spec[key] = VARIANT_KEYS[key](value)
        except (KeyError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {key}={value!r} is not a valid value") from exc
    return spec


def variant_label(spec: dict) -> str:
    """How a CLI variant reads on the page ('' for the CLI as it runs)."""
    text = "" if spec.get("switch") is None else f", GIL switch interval {spec['switch'] * 1e3:g} ms"
    text += "" if spec.get("chunk") is None else f", writers hashing {spec['chunk'] / 2**20:g} MiB a call"
    text += "" if spec.get("copy") is None else f", {spec['copy']} torch threads for the row copies (a measurement)"
    text += {True: ", rows placed by the worker", False: ", rows through the ring slot (a measurement)"}.get(
        spec.get("place"), ""
    )
    text += "" if spec.get("finite", True) else ", NaN/Inf test off (a measurement, not a setting)"
    text += {"off": ", --no-direct-io", "always": ", O_DIRECT on tmpfs too (as before 2026-12-06; a measurement)"}.get(
        spec.get("direct", "auto"), ""
    )
    return text + ("" if spec.get("helpers") is None else f", --write-helpers {spec['helpers']}")


def cli_writers(hidden: int, layers: int, dtype: str, workers: int | None, helpers: str | None) -> tuple[int, bool]:
    """The write workers and whether helpers write, as the CLI resolves them on this host (run/pipeline.py)."""
    from speculators_v016.config import write_helpers_used, write_workers_for  # noqa: PLC0415 - parent only
    from speculators_v016.store.disk_forecast import stored_token_bytes  # noqa: PLC0415 - the same

    used = write_helpers_used(helpers or "off")
    weight = stored_token_bytes(layers, hidden, 2, dtype == "fp8_e4m3")
    return workers or write_workers_for(len(os.sched_getaffinity(0)), weight, used), used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=shape_key, nargs="+", default=[4096, 7168], choices=list(SHAPES))
    ap.add_argument("--sides", nargs="+", default=["vllm", "uni", "mp"], choices=["vllm", "vllm-aux", "uni", "mp"],
                    help="vllm-aux: vLLM's own loop with the capture's aux states computed and dropped "
                         "(aux_only.py): vllm-aux / vllm is the capture's arithmetic, uni / vllm-aux the rest")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--low", type=int, default=1024, help="shortest prompt (tokens)")
    ap.add_argument("--high", type=int, help="longest prompt (tokens; default 4096, kimi 8192)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--memory", type=float, help="each side's gpu_memory_utilization (default 0.25, kimi 0.4)")
    ap.add_argument("--cli", action="store_true", help="also the CLI writing files (every shape), against uni")
    ap.add_argument("--cli-runs", type=int, default=2, help="runs of the CLI (--cli)")
    ap.add_argument("--cli-out", nargs="+", type=Path, help="folders the CLI writes under, each in turn "
                    "(--cli; default: under --where), with the rate one thread writes there")  # fmt: skip
    ap.add_argument("--cli-write-workers", type=int, nargs="+", help="the CLI's --write-workers, each in turn "
                    "(--cli; default: the CLI's default)")  # fmt: skip
    ap.add_argument("--cli-switch-intervals", type=float, nargs="+", help="also run the CLI with these GIL switch "
                    "intervals (seconds, sys.setswitchinterval; Python's is 0.005), each in turn (--cli)")  # fmt: skip
    ap.add_argument("--cli-write-chunks", type=int, nargs="+", help="also run the CLI with its writers hashing and "
                    "testing this many bytes a call (e.g. 1073741824: whole tensors; the writer's: 4 MiB), each in "
                    "turn (--cli)")  # fmt: skip
    ap.add_argument("--cli-variants", type=cli_variant, nargs="+", default=[], metavar="SPEC",
                    help="also run the CLI so, each in turn: key=value pairs, comma-separated (switch: the GIL switch "
                    "interval in s; chunk: bytes hashed a call; workers; copy: torch threads for the row copies; finite=off: no NaN/Inf test, a "
                    "measurement only; direct=off: --no-direct-io, direct=always: O_DIRECT on tmpfs too, a measurement only), e.g. switch=0.0002,workers=12 (--cli)")  # fmt: skip
    ap.add_argument("--cli-variants-at", type=shape_key, nargs="+", help="the variants (--cli-variants, "
                    "--cli-switch-intervals, --cli-write-chunks) at these shapes only (default: every shape)")  # fmt: skip
    ap.add_argument("--cli-variants-dtypes", nargs="+", choices=["auto", "fp8_e4m3"], help="the variants for these "
                    "--cli-dtypes only (default: every one)")  # fmt: skip
    ap.add_argument("--cli-warmup", action=argparse.BooleanOptionalAction, default=True, help="one untimed CLI "
                    "run per shape and folder before the timed ones (default on), as each side's timed passes follow "
                    "a warm-up pass: a lent machine's first writes into fresh memory pages of a folder in RAM cost "
                    "more (2026-12-06, an H100 host: a first run 109,291 tokens/s, the next 148,276)")  # fmt: skip
    ap.add_argument("--cli-prompts", type=int, help="prompts the CLI writes (default: --prompts; its files must fit "
                    "under --cli-out: 256 prompts at hidden 7168 are 28 GB)")  # fmt: skip
    ap.add_argument("--cli-consume", action="store_true", help="a consumer thread deletes each of the CLI's files "
                    "once its manifest lists it, as the online mode's trainer does, so a CLI run as long as the sides' "
                    "passes (--cli-prompts left out) fits in a folder in RAM (its files and CPU-s in the host line)")  # fmt: skip
    ap.add_argument("--cli-write-helpers", nargs="+", choices=["on", "off"], help="the CLI's --write-helpers, "
                    "each in turn for every variant (--cli; default: its default, off)")  # fmt: skip
    ap.add_argument(
        "--cli-dtypes",
        nargs="+",
        default=["auto"],
        choices=["auto", "fp8_e4m3"],
        help="the CLI's --hidden-states-dtype, each in turn (--cli)",
    )
    ap.add_argument("--cli-py-spy", type=Path, help="also one CLI run per shape and dtype under py-spy (every "
                    "thread, waits included), its speedscope profile gzipped into this folder (not timed)")  # fmt: skip
    ap.add_argument("--cli-py-spy-at", type=shape_key, nargs="+", help="--cli-py-spy at these shapes only")
    ap.add_argument("--side-py-spy", type=Path, help="after the timed rounds, one more pass of every side under "
                    "py-spy (--nonblocking: the process is not paused; its child processes too), the speedscope "
                    "profiles gzipped into this folder (not timed)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="GPU time in our copies (torch profiler, uni side)")
    ap.add_argument("--profile-trace", type=Path, help="also a shorter uni pass traced with the host's ops "
                    "(trace_gaps.py: the device's idle gaps and what the host ran in them), its Chrome trace "
                    "gzipped into this folder")  # fmt: skip
    ap.add_argument("--eager", action="store_true", help="eager engines (a trial; measurements are compiled)")
    ap.add_argument("--where", default="/tmp/speculators-v016-gpu-bench")
    ap.add_argument("--before", type=Path, help="also the side uni-before: uni with this checkout's package "
                    "(a folder holding speculators_v016/), in the same rounds: uni / uni-before is the change")  # fmt: skip
    opts = ap.parse_args()
    if opts.before is not None and "uni" not in opts.sides:
        ap.error("--before compares uni-before with uni: add uni to --sides")
    if opts.before is not None:
        opts.before = opts.before.resolve()
        if not (opts.before / "speculators_v016" / "__init__.py").is_file():
            ap.error(f"--before {opts.before}: no speculators_v016 package there")
    for hidden in opts.shapes:  # before anything runs
        memory = opts.memory or SHAPES[hidden].get("memory", 0.25)
        count = len(opts.sides) + (opts.before is not None)
        if memory * count > 0.95:
            ap.error(f"shape {hidden}: {count} sides at --memory {memory} hold more than the GPU; "
                     "run fewer --sides or a smaller --memory")  # fmt: skip
    lines = []
    imported: dict[str, str] = {}  # side -> the package it imported (the ready line)
    cli_tokens: dict[int, int] = {}  # each shape's CLI prompts' tokens
    warmups: list[str] = []  # the untimed CLI runs (--cli-warmup): shape, dtype, tokens/s
    for hidden in opts.shapes:
        s = SHAPES[hidden]
        high, memory = opts.high or s.get("high", 4096), opts.memory or s.get("memory", 0.25)
        model = bench_model(Path(opts.where), hidden)
        args = dict(model=model, count=opts.prompts, low=opts.low, high=high, vocab=s["vocab"], layers=s["layers"],
                    max_num_seqs=opts.max_num_seqs, batched_tokens=opts.batched_tokens, memory=memory,
                    eager=opts.eager, kimi=s.get("kimi", False))  # fmt: skip
        if opts.cli and opts.cli_prompts and opts.cli_prompts != opts.prompts:  # uni passes over the CLI's own too
            args["cli_count"] = opts.cli_prompts
        names = [*opts.sides, *(["uni-before"] if opts.before else [])]
        sides = []
        try:
            for name in names:
                sides.append(start_side({**args, "side": name}, opts.before))
            packages = {x.name: x.ready.get("package") for x in sides}
            if opts.before and packages["uni"] == packages["uni-before"]:
                raise SystemExit(f"uni and uni-before both imported {packages['uni']}: nothing to compare (--before)")
        except BaseException:
            for running in sides:
                running.close()
            raise
        modes = {x.name: x.ready.get("async_scheduling") for x in sides}
        print(f"hidden {hidden}: async scheduling by side {modes}", file=sys.stderr, flush=True)
        if len({modes[k] for k in ("vllm", "vllm-aux") if k in modes}) > 1:  # vLLM's two loops must match
            for running in sides:
                running.close()
            raise SystemExit(f"vllm and vllm-aux do not schedule alike (async scheduling by side: {modes})")
        memory_lines = {x.name: x.ready["memory"] for x in sides if x.ready.get("memory")}
        rates: dict[str, list[float]] = {name: [] for name in names}
        streams: dict[str, list[dict]] = {name: [] for name in names}  # each timed pass's engine stats
        own: list[dict] = []  # uni's timed passes (tokens_per_s, stream)
        same: list[dict] = []  # uni's passes over the CLI's prompts, where they are not the sides' (cli_count)
        for _ in range(opts.rounds):
            for running in sides:
                reply = running.ask()
                rates[running.name].append(reply["tokens_per_s"])
                if reply.get("stream"):
                    streams[running.name].append(reply["stream"])
                if running.name == "uni":
                    own.append(reply)
                    if args.get("cli_count"):
                        same.append(running.ask("run cli"))
        prof = next((x.ask("profile") for x in sides if x.name == "uni"), None) if opts.profile else None
        if prof is not None and opts.profile_trace:
            path = opts.profile_trace.resolve() / f"trace-{hidden}-uni.json.gz"
            prof["trace"] = next(x.ask(f"trace {path}") for x in sides if x.name == "uni")
        for running in sides if opts.side_py_spy else []:
            side_py_spy(running, opts.side_py_spy / f"side-{hidden}-{running.name}.speedscope.json")
        for running in sides:
            running.close()
        print(f"hidden {hidden}: {json.dumps(rates)} profile {json.dumps(prof)}", file=sys.stderr, flush=True)
        cli = []
        if opts.cli:
            data = Path(opts.where) / f"prompts-{hidden}.jsonl"
            batch = prompts(opts.cli_prompts or opts.prompts, opts.low, high, s["vocab"])
            cli_tokens[hidden] = sum(map(len, batch))
            data.write_text("".join(json.dumps({"input_ids": p, "loss_mask": [1] * len(p)}) + "\n" for p in batch))
            for parent in opts.cli_out or [Path(opts.where)]:
                count, _ = cli_writers(s.get("hidden", hidden), len(layer_ids(s["layers"])), "auto", None, None)
                disk = (write_rate(parent), count, writers_rate(parent, count))  # one thread; the bf16 writers
                if opts.cli_warmup:  # as the sides' timed passes follow a warm-up pass: see --cli-warmup
                    rate, _ = cli_rate(model, data, parent / "cli-out", args, None, opts.cli_dtypes[0],
                                       consume=opts.cli_consume)  # fmt: skip
                    print(f"CLI warm-up under {parent} ({opts.cli_dtypes[0]}, not timed): {rate:,.0f} tokens/s",
                          file=sys.stderr, flush=True)  # fmt: skip
                    warmups.append(f"{hidden} {opts.cli_dtypes[0]} {rate:,.0f}")
                for dtype in opts.cli_dtypes:
                    for workers in opts.cli_write_workers or [None]:
                        variants = [{}]
                        if hidden in (opts.cli_variants_at or [hidden]) and dtype in (opts.cli_variants_dtypes or
                                                                                      [dtype]):  # fmt: skip
                            variants += [
                                *({"switch": x} for x in opts.cli_switch_intervals or []),
                                *({"chunk": x} for x in opts.cli_write_chunks or []),
                                *opts.cli_variants,
                            ]
                        ran = set()  # the writers each variant resolves to: one that repeats another is not run again
                        for spec, helpers in itertools.product(variants, opts.cli_write_helpers or [None]):
                            count = spec.get("workers", workers)
                            writers = cli_writers(s.get("hidden", hidden), len(layer_ids(s["layers"])), dtype, count,
                                                  helpers)  # fmt: skip
                            key = (tuple(sorted((k, v) for k, v in spec.items() if k != "workers")), writers)
                            if key in ran:
                                print(f"CLI --write-helpers {helpers} at {hidden} {dtype}: the same writers as a run "
                                      f"before ({writers}), not run again", file=sys.stderr, flush=True)  # fmt: skip
                                continue
                            ran.add(key)
                            done = [cli_rate(model, data, parent / "cli-out", args, count, dtype,
                                             switch=spec.get("switch"), chunk=spec.get("chunk"), helpers=helpers,
                                             finite=spec.get("finite", True), direct=spec.get("direct", "auto"),
                                             consume=opts.cli_consume, copy=spec.get("copy"),
                                             place=spec.get("place"))
                                    for _ in range(opts.cli_runs)]  # fmt: skip
                            cli.append((parent, disk, dtype, count, {**spec, "helpers": helpers},
                                        [r for r, _ in done], done[-1][1]))  # fmt: skip
                    if opts.cli_py_spy and hidden in (opts.cli_py_spy_at or [hidden]):
                        profiled = opts.cli_py_spy / f"cli-{hidden}-{dtype}.speedscope.json"
                        _, host = cli_rate(model, data, parent / "cli-out", args, None, dtype, profiled,
                                           consume=opts.cli_consume)  # fmt: skip
                        subprocess.run(["gzip", "-f", str(profiled)], check=False)
                        print(f"py-spy profile {profiled}.gz; host path: {host}", file=sys.stderr, flush=True)
        lines.append((hidden, s, rates, cli, prof, high, memory, memory_lines, streams, same or own))
        imported.update(packages)
    from speculators_v016.store.disk_forecast import stored_token_bytes  # noqa: PLC0415 - parent only

    with recording(__file__):
        cli_prompts = f" (the CLI: {opts.cli_prompts})" if opts.cli and opts.cli_prompts else ""
        print(f"{opts.prompts} prompts a pass{cli_prompts}, bf16, {'eager' if opts.eager else 'compiled (CUDA graphs)'}, "
              f"max_num_batched_tokens {opts.batched_tokens}, max_num_seqs {opts.max_num_seqs}, up to {CAPTURE} "
              f"layers captured, {opts.rounds} interleaved rounds, medians; vllm = LLMEngine (add_request, step), "
              "vllm-aux = the same computing the capture's aux states, nothing copied, "
              "uni / mp = the generator's stream() with the uniprocess / multiprocess (TP 1) executor")  # fmt: skip
        if opts.before:
            print(f"uni-before: the package at {imported.get('uni-before')} ({checkout_commit(opts.before)}); uni: "
                  f"the package at {imported.get('uni')}")  # fmt: skip
        if warmups:
            print(f"the CLI's runs each follow one untimed warm-up run per shape and folder (--cli-warmup; shape, "
                  f"stored, tokens/s: {'; '.join(warmups)})")  # fmt: skip
        for hidden, s, rates, cli, prof, high, memory, memory_lines, streams, base_passes in lines:
            med = {k: statistics.median(v) for k, v in rates.items() if v}
            if s.get("kimi"):
                print(f"kimi: Kimi-K2.5 slice, {s['layers']} layers (dense, then 2 x 384 INT4 W4A16 experts), hidden "
                      f"7168, MLA (TRITON_MLA), vocabulary {s['vocab']}, {len(layer_ids(s['layers']))} layers "
                      f"captured, prompts of {opts.low}-{high} tokens, gpu_memory_utilization {memory} a side:")  # fmt: skip
            else:
                print(f"hidden {hidden}, {s['layers']} layers, vocabulary {s['vocab']}, MLP {s['intermediate']}, "
                      f"prompts of {opts.low}-{high} tokens:")  # fmt: skip
            for name, values in rates.items():
                print(f"  {name:10} {med[name]:12,.0f} tokens/s   (rounds: {', '.join(f'{v:,.0f}' for v in values)})")
            pairs = (
                [(name, "vllm") for name in med if name != "vllm"]
                + [(name, "vllm-aux") for name in med if name not in ("vllm", "vllm-aux")]
                + [("uni", "uni-before")]
            )
            for name, against in pairs:
                if name in med and against in med:
                    per_round = [a / b for a, b in zip(rates[name], rates[against])]
                    print(f"  ratio {name} / {against}: {med[name] / med[against]:.3f}x (per round: "
                          f"{', '.join(f'{r:.3f}' for r in per_round)})")  # fmt: skip
            for name, passes in streams.items():
                missing = sorted({k for x in passes for k in STREAM_STATS if k not in x})
                if passes and missing:  # a --before checkout older than these counters
                    print(f"  {name}: its EngineStats have no {', '.join(missing)} (an older checkout)")
                elif passes:
                    drained = ", ".join(f"{x['drained'] * 1e3:,.0f}" for x in passes)
                    thread = statistics.median(x["copy_thread"] for x in passes)
                    waited = statistics.median(x["copy_waited"] for x in passes)
                    faulted = ", ".join(f"{x['prefault_hits']}/{x['prefault_misses']}" for x in passes)
                    print(f"  {name}, each timed pass's end (EngineStats): drained in {drained} ms (every prompt fed, "
                          f"no step in flight, to the stream's end); copy thread {thread:.2f} s, the engine's thread "
                          f"waited on it {waited * 1e3:,.0f} ms (medians); prefault hits/misses {faulted}")  # fmt: skip
            # the CLI against uni's passes over the same prompts: the sides' own, or (--cli-prompts) uni's over the CLI's
            base = statistics.median(x["tokens_per_s"] for x in base_passes) if base_passes else None
            if base_passes and opts.cli_prompts and opts.cli_prompts != opts.prompts:
                each = ", ".join(f"{x['tokens_per_s']:,.0f}" for x in base_passes)
                print(f"  uni over the CLI's {opts.cli_prompts} prompts: {base:,.0f} tokens/s (rounds: {each}); the "
                      "CLI's ratios below are against these passes")  # fmt: skip
            for parent, (disk, count, together), dtype, workers, spec, runs, host in cli if base else []:
                stored = "bf16" if dtype == "auto" else dtype
                gil = variant_label(spec)
                token = stored_token_bytes(len(layer_ids(s["layers"])), s.get("hidden", hidden), 2, dtype == "fp8_e4m3")
                print(f"  CLI writing files under {parent} (one thread writes {disk:.2f} GiB/s there; {count} threads "
                      f"hashing and writing {together:.2f} GiB/s together; uni's stream of {stored} states "
                      f"{med['uni'] * token / 2**30:.2f} GiB/s), {stored} "
                      f"stored, {workers or 'default'} write workers{gil}: {statistics.median(runs):,.0f} tokens/s to the "
                      f"last durable file (runs: {', '.join(f'{v:,.0f}' for v in runs)}); ratio CLI / uni: "
                      f"{statistics.median(runs) / base:.3f}x")  # fmt: skip
                steady = to_last_sample(runs[-1], host, cli_tokens[hidden]) if hidden in cli_tokens else None
                if steady is not None:
                    print(f"    to the engine's last sample (the last run, without its {steady[1]:.2f} s tail to the "
                          f"last durable file, which a run pays once): {steady[0]:,.0f} tokens/s, "
                          f"{steady[0] / base:.3f}x of uni")  # fmt: skip
                    print(f"    {where_time(steady, host, cli_tokens[hidden], base_passes)}")
                if host:
                    print(f"    host path (last run's summary): {host}")
            if prof:
                share = ", ".join(f"{k} {v:.2%}" for k, v in sorted(prof["share"].items()))
                print(f"  GPU time of one uni pass by kind (torch profiler): {share}; compute kernels busy "
                      f"{prof['compute_busy']:.1%} of the pass's {prof['wall_ms']:,.0f} ms")  # fmt: skip
                idle = prof.get("idle") or {}
                if idle:
                    print(f"  the device's idle time in that pass (no kernel or copy but those to the host, from its "
                          f"first event to its last, {idle['window_ms']:,.0f} ms, {idle['events']:,} events): "
                          f"{idle['idle_ms']:,.1f} ms; in {idle['gaps_0.1ms']:,} gaps of 0.1 ms or more "
                          f"{idle['idle_in_gaps_0.1ms_ms']:,.1f} ms, in {idle['gaps_1ms']:,} of 1 ms or more "
                          f"{idle['idle_in_gaps_1ms_ms']:,.1f} ms; the largest {idle['largest_gap_ms']:.2f} ms")  # fmt: skip
                traced = prof.get("trace")
                if traced:
                    print(f"  traced uni pass of {traced['prompts']} prompts (CPU and CUDA activities; trace_gaps.py): "
                          f"{traced['text']}")  # fmt: skip
            for name, m in memory_lines.items():
                staging = m["staging"]
                print(f"  {name}: capture ring {m['ring']} (host memory; on a GPU the output worker registers it as pinned memory: "
                      f"{m['ring_bytes'] / 2**20:,.0f} MiB); copy path {m['copy_path']}; GPU staging "
                      f"{staging.get('buffers', 0)} buffers, {staging.get('bytes', 0) / 2**20:,.0f} MiB "
                      f"({'used' if staging.get('staged') else 'not used'})"
                      + (f"; read in place: {m['in_place']}" if m.get("in_place") else ""))  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        side(json.loads(sys.argv[1]))
    else:
        main()
elif __name__ == "__mp_main__" and os.environ.get(STAND_INS) == "1":  # a process vLLM spawned for a kimi side
    from speculators_v016.testing import gpu_kit

    gpu_kit.install()
