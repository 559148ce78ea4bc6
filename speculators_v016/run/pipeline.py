"""One data-generation run: dataset -> samples -> engine -> verified files.

The steps, each owned by a module: :mod:`~speculators_v016.run.dataset`
(rows to token samples), :mod:`~speculators_v016.store.outdir` (folder, lock),
:mod:`~speculators_v016.store.run_config` (fingerprint, resume check,
``data_config.json``), :mod:`~speculators_v016.engine.core` (hidden states, streamed),
:mod:`~speculators_v016.store.writer` and :mod:`~speculators_v016.store.manifest`
(atomic files, then their manifest lines, committed in groups).

The run checks what it captured before it writes it (its *self-check*): every
sample's layers are screened, row by row, for states no model produces (rows
all zeros, one row repeated for different tokens: :mod:`~speculators_v016.checks.degenerate`; by the
writer's threads just before they write each sample, and on this thread while samples are held back), and the first
``logit_check_samples`` samples' last layer must reproduce vLLM's own prompt
logprobs (:mod:`~speculators_v016.checks.logit_check`). Until the logit check has
judged its samples, every finished sample is held back from the writer; a
failure stops the run with :class:`SelfCheckError` (exit 7) before anything it
judged is written, so a resume redoes them (both in :mod:`~speculators_v016.checks.self_check`).
"""

from __future__ import annotations

import errno
import os
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from itertools import chain
from pathlib import Path

import numpy as np
import torch
from loguru import logger
from tqdm import tqdm
from transformers import AutoTokenizer

import speculators_v016
from speculators_v016 import fp8
from speculators_v016.checks.finite import non_finite_reason
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.checks.self_check import HoldBack, NonFiniteError, WriterScreen
from speculators_v016.checks.self_check import SelfCheckError as SelfCheckError  # re-exported: callers import it here
from speculators_v016.checks.zero_embeddings import zero_embedding_ids
from speculators_v016.config import RunConfig, last_samples_threads, write_helpers_used, write_workers_for
from speculators_v016.engine import arg_kinds
from speculators_v016.engine.buffer_pool import MALLOC_MMAP_CEILING, BufferPool
from speculators_v016.engine.engine_args import check_engine_args, vllm_defaults
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.layers import LayerPlan
from speculators_v016.redact import redact
from speculators_v016.run import chat_samples, huge_pages, prefill
from speculators_v016.run.mid_run import MidRun
from speculators_v016.run.prefill import PrefillWork
from speculators_v016.run.regenerate import RegenerationWork
from speculators_v016.shared.shm_records import reclaim_and_log
from speculators_v016.store import checksum as checksums
from speculators_v016.store import disk_forecast, run_config
from speculators_v016.store.atomic_files import WriteError
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.outdir import OutputDir, ShardedRoot, shard_dir, shard_siblings
from speculators_v016.store.regenerated import NOT_GENERATED, STOPPED, not_generated
from speculators_v016.store.sample_format import DATA_ALIGN, MODEL_ARGS_KEY, parse_sample_name
from speculators_v016.store.writer import SampleWriter
from speculators_v016.target import PromptError, TargetInfo, check_token_ids

FINISHED = {"stop": "ended by the target", "length": "cut at --max-new-tokens (kept, marked)"}
#: What the start line and the summary say of the --engine-args that change the model.
MODEL_ARGS_NOTE = (
    "--engine-args that change the model's computation or tokenization: the states are of the model so changed; "
    "data_config.json and each file's header name them"
)


@dataclass
class RunSummary:
    output_dir: str
    written: int = 0
    already_done: int = 0
    skipped: dict = field(default_factory=dict)
    non_finite: list = field(default_factory=list)
    truncated: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    generation_seconds: float = 0.0
    logit_check: dict = field(default_factory=dict)
    regenerated: dict = field(default_factory=dict)  # --regenerate: turns by finish reason
    conversations: dict = field(default_factory=dict)  # --regenerate: conversations by how they went into samples
    stopped: dict = field(default_factory=dict)  # --regenerate: conversations stopped at a tool call, by why
    model_args: dict = field(default_factory=dict)  # --engine-args that change the model (engine.arg_kinds)
    host: dict = field(default_factory=dict)  # where the generation's time went on the host (host_line)
    dropped: int = 0  # sample names of this shard without a file: rows dropped after tokenizing (in skipped)
    prepared_cache: str = ""  # the prepared-rows cache: its place and size

    def lines(self) -> list[str]:
        rate = self.tokens / self.generation_seconds if self.generation_seconds else 0.0
        out = [f"output:     {self.output_dir}"]
        if self.model_args:
            out.append(f"model args: {arg_kinds.describe(self.model_args)} ({MODEL_ARGS_NOTE})")
        out += [
            f"written:    {self.written} samples ({self.already_done} already done before this run)",
            f"tokens:     {self.tokens} in {self.generation_seconds:.1f} s of generation to the last file made durable "
            f"({rate:,.0f} tokens/s; {self.seconds:.1f} s in all)",
            f"bytes:      {self.bytes:,}",
            f"truncated:  {self.truncated} (to --seq-length; loss masks cut alongside)",
        ]
        out += [f"skipped:    {n} {reason}" for reason, n in sorted(self.skipped.items())] or ["skipped:    0"]
        if self.dropped:
            out.append(
                f"gaps:       {self.dropped} sample names of this shard have no file (their rows were dropped after "
                "tokenizing, counted above)"
            )
        if self.prepared_cache:
            out.append(f"prepared:   {self.prepared_cache}")
        if self.regenerated:
            reasons = ", ".join(f"{n} {FINISHED.get(r, r)}" for r, n in sorted(self.regenerated.items()))
            out.append(f"regenerated: {sum(self.regenerated.values())} turns ({reasons})")
        if self.conversations:
            shapes = ", ".join(f"{n} {shape}" for shape, n in sorted(self.conversations.items()))
            out.append(f"conversations: {sum(self.conversations.values())} finished ({shapes})")
        if self.stopped:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.stopped.items()))
            out.append(f"stopped:    {sum(self.stopped.values())} conversations at a tool call ({why})")
        if self.host:
            out.append(f"host path:  {host_line(self.host)}")
        if self.logit_check:
            out.append(f"logit check: {self.logit_check['line']}")
        return out


def fingerprint(opts: RunConfig, samples, layer_ids: list[int]) -> dict:
    generation = {
        "layer_ids": layer_ids,
        "format": opts.format,
        "dtype": opts.engine.dtype,
        "start_idx": opts.start_idx,
        "num_shards": opts.num_shards,
        "shard_index": opts.shard_index,
    }
    if opts.engine.hidden_states_dtype != "auto":  # absent for "auto": folders of earlier releases still resume
        generation["hidden_states_dtype"] = opts.engine.hidden_states_dtype
    if opts.regenerate:  # absent otherwise: folders of earlier releases still resume
        generation["regenerate"] = samples.describe()
    extra = opts.engine.extra_engine_args
    if extra:  # absent without: folders of earlier releases still resume
        generation["engine_args"] = redact(extra)  # a secret is named, never written (the resume check skips it)
    preprocessing = {
        "seq_length": opts.seq_length,
        "max_samples": opts.max_samples,
        "seed": opts.seed,
        "assistant_pattern": opts.assistant_pattern,
        "turn_dropout": opts.turn_dropout,
    }
    if samples.kind == "conversations" and not opts.regenerate:  # how rows become samples: a folder made before
        preprocessing["conversations"] = chat_samples.READING  # (upstream's pattern mask) is not resumed
    out = {
        "model": run_config.model_fingerprint(opts.engine.model),
        "dataset": {"sources": samples.sources, "kind": samples.kind},
        "preprocessing": preprocessing,
        "generation": generation,
    }
    files = {k: run_config.files_fingerprint(extra[k]) for k in FILE_ARGS if isinstance(extra.get(k), str)}
    if files:  # absent without: folders of earlier releases still resume
        out["engine_arg_files"] = files
    return out


#: Engine arguments naming a tokenizer or a config whose contents the fingerprint holds.
FILE_ARGS = run_config.ENGINE_ARG_FILES


def run(opts: RunConfig, progress_to=None) -> RunSummary:
    """Make the samples of ``opts``; a progress bar goes to ``progress_to`` (a text stream) if given."""
    started = time.monotonic()
    target = TargetInfo.read(opts.engine.model, opts.engine.trust_remote_code)  # remote code refused first
    # vLLM takes --engine-args and --seq-length, before the dataset is read or the folder touched
    model_config = check_engine_args(opts.engine).model_config
    reclaim_and_log()  # dead runs' shared memory, also when this run has nothing left to do
    directory = shard_dir(Path(opts.output_dir), opts.shard_index, opts.num_shards)
    plan = LayerPlan.build(target.num_layers, opts.layer_ids)
    summary = RunSummary(str(directory))
    summary.model_args = arg_kinds.model_changing(opts.engine.extra_engine_args, vllm_defaults())
    root = ShardedRoot(Path(opts.output_dir), opts.num_shards) if opts.num_shards > 1 else nullcontext()
    with root, OutputDir(directory, inside=opts.num_shards > 1) as out:
        if out.removed_leftovers:
            logger.warning("removed {} temporary files left by an interrupted run", len(out.removed_leftovers))
        tokenizer = AutoTokenizer.from_pretrained(
            opts.engine.tokenizer, trust_remote_code=opts.engine.trust_remote_code
        )
        if opts.regenerate:
            bar, progress = prefill.reading_bar(progress_to, opts.progress)
            try:
                work = RegenerationWork.prepare(opts, tokenizer, progress)
            finally:
                bar.close()
        else:
            wants_counts = bool(opts.token_freq_path) and not prefill.token_counts_kept(opts.token_freq_path)
            work = PrefillWork.prepare(opts, tokenizer, progress_to, token_counts=wants_counts)
        try:
            return _run_work(opts, work, target, model_config, directory, plan, summary, started, progress_to)
        finally:
            if not opts.regenerate:
                work.close()


def _run_work(opts, work, target, model_config, directory, plan, summary, started, progress_to) -> RunSummary:
    """The run, its work prepared (see :func:`run`)."""
    summary.skipped, summary.truncated = dict(work.skipped), work.truncated
    if not work.count:
        raise PromptError(f"no usable sample in {list(opts.train_data_path)} (skipped: {dict(work.skipped)})")
    fp = fingerprint(opts, work, list(plan.layer_ids))
    _check_shards(opts, directory, fp, summary.model_args)
    has_samples = any(parse_sample_name(p.name) for p in directory.iterdir())
    existing = run_config.check_resume(directory, fp, has_samples)
    if existing is not None and not opts.regenerate:
        prefill.check_numbering(directory, existing, work.count)
        existing["speculators_v016"]["numbering"] = prefill.NUMBERING  # proven the same (an earlier release's)
    done = Manifest(directory).reconcile()
    algorithm = checksum_of_run(directory, existing, done, opts.checksum)
    mine = np.asarray(work.shard(opts.num_shards, opts.shard_index), np.int64)
    settled = work.settled(directory, done) if opts.regenerate else set()  # folded into listed samples
    pending = pending_positions(mine, opts.start_idx, done, settled)
    summary.already_done = len(mine) - len(pending)
    if len(pending) and not opts.regenerate and not work.begin(pending):  # every pending row dropped: no engine
        work.settle()
        _note_prepared(work, summary, opts)
        if existing is None:
            raise PromptError(
                f"no usable sample in shard {opts.shard_index} of {list(opts.train_data_path)} "
                f"(skipped: {dict(work.skipped)})"
            )
        logger.info("the {} rows not written of this shard have no sample (dropped after tokenizing)", len(pending))
        summary.already_done = len(mine) - len(pending)
        summary.seconds = time.monotonic() - started
        existing["speculators_v016"]["last_run"] = asdict(summary)
        run_config.save(directory, existing)
        return summary
    if not len(pending):
        logger.info("all {} samples of this shard are already written", len(mine))
        if opts.regenerate:  # a run killed before it wrote regenerated.jsonl: written now
            work.begin(directory, [], done, None)
            work.end(directory, set(done))
        summary.seconds = time.monotonic() - started
        return summary
    cut = work.cut_without_engine(directory, pending, done) if opts.regenerate and existing else None
    if cut is not None:  # every turn left has no room (a finished run, run again): nothing for the engine
        logger.bind(terminal=True).info(
            "nothing to generate: the {} turns not written {}",
            len(cut),
            _cut_why(cut, opts),
        )
        _note_cut(cut, summary, opts)
        summary.stopped = work.stops
        work.begin(directory, [], done, None)
        work.end(directory, set(done))
        summary.seconds = time.monotonic() - started
        existing["speculators_v016"]["last_run"] = asdict(summary)  # what is not written, and why: verify counts it
        run_config.save(directory, existing)
        return summary
    if opts.regenerate:
        _forecast_disk(directory, None, "", len(plan.layer_ids), model_config, opts)
    else:
        for i, ids in work.head_samples():  # before the engine starts (the rest: as the engine takes them)
            check_token_ids(f"sample {i}", ids, target.vocab_size, f" of {opts.engine.model}")
        _forecast_disk(directory, *_prefill_tokens(work, pending), len(plan.layer_ids), model_config, opts)
    zero_ids = zero_embedding_rows(opts.engine.model, target.vocab_size)
    cpus = os.sched_getaffinity(0)  # before vLLM's CPU worker pins this thread to one core
    given = opts.write_workers is not None  # then that many threads, none more for the last samples
    if opts.write_workers is None:  # from the bytes a token weighs and the cores (said in the host path line)
        weight = disk_forecast.stored_token_bytes(
            len(plan.layer_ids), model_config.get_hidden_size(), model_config.dtype.itemsize, opts.engine.fp8
        )
        opts = replace(opts, write_workers=write_workers_for(len(cpus), weight, write_helpers_used(opts.write_helpers)))
    generator = VllmHiddenStatesGenerator.from_config(opts.engine, plan)
    try:
        config = existing or _new_config(generator, opts, work, fp, len(mine))
        config["speculators_v016"]["checksum"] = algorithm  # an earlier release's folder: now said
        config["speculators_v016"]["zero_embedding_token_ids"] = sorted(zero_ids)  # verify's screen reads them
        run_config.save(directory, config)
        _announce(generator, opts, len(pending), summary.already_done, summary.model_args)
        model_args = config["speculators_v016"].get(MODEL_ARGS_KEY) or {}  # what verify expects in headers
        _generate(
            generator, work, pending, directory, opts, summary, progress_to, cpus, algorithm, done, zero_ids,
            model_args, target.vocab_size, given,
        )  # fmt: skip
    finally:
        generator.shutdown()
    if opts.regenerate and opts.token_freq_path:
        _save_token_frequencies_of(work.records.values(), opts.token_freq_path)
    if not opts.regenerate:
        work.settle()  # chunks read only for the token counts
        _note_prepared(work, summary, opts)
        if work.token_counts is not None:
            _save_token_counts(work.token_counts, opts.token_freq_path)
    summary.seconds = time.monotonic() - started
    config["speculators_v016"]["last_run"] = asdict(summary)
    run_config.save(directory, config)
    # again: a shard started beside this one, before either had written its config
    _check_shards(opts, directory, fp, summary.model_args)
    return summary


def _check_shards(opts: RunConfig, directory: Path, fp: dict, model_args: dict) -> None:
    """A shard's settings against its sibling shards' (:func:`~speculators_v016.store.run_config.check_shards_agree`)."""
    if opts.num_shards > 1:
        siblings = shard_siblings(Path(opts.output_dir), opts.shard_index, opts.num_shards)
        run_config.check_shards_agree(directory, fp, siblings, model_args)


def pending_positions(mine: np.ndarray, start_idx: int, done, settled) -> np.ndarray:
    """The positions of ``mine`` (int64) whose names (``start_idx`` + position) are in neither ``done`` nor
    ``settled`` (collections of names), in ``mine``'s order: ``mine`` itself where none of them is done."""
    names = np.fromiter(chain(done, settled), np.int64, len(done) + len(settled))
    if not len(names):
        return mine
    return mine[~np.isin(mine, names - start_idx)]


def _prefill_tokens(work: PrefillWork, pending: np.ndarray) -> tuple[int, str]:
    """The pending samples' tokens: exact where all are tokenized, else estimated from the rows that are."""
    exact = work.tokens(pending)
    if exact is not None:
        return exact, ""
    tokens, rows = work.estimated_tokens(pending)
    return tokens, f" (estimated from the first {rows:,} rows tokenized)"


def _note_prepared(work: PrefillWork, summary: RunSummary, opts: RunConfig) -> None:
    """What preparing this shard's rows dropped, in the summary; and the cache's place and size."""
    summary.skipped.update(work.skipped)  # the rows dropped as read, and those dropped after tokenizing
    summary.truncated, summary.dropped = work.truncated, work.dropped
    summary.prepared_cache = prefill.cache_line(prefill.cache_folder(opts))


def _forecast_disk(directory: Path, tokens: int | None, note: str, layers: int, model_config, opts: RunConfig) -> None:
    """The bytes this run will write against its folder's free space, said on the terminal; refused where they
    cannot fit (unless --ignore-disk-forecast). No forecast where the tokens are not known yet (--regenerate);
    ``note``: where they are estimated, from what."""
    if tokens is None:
        return
    fp8 = opts.engine.fp8
    found = disk_forecast.forecast(
        directory, tokens, layers, model_config.get_hidden_size(), model_config.dtype.itemsize, fp8
    )
    logger.bind(terminal=True).info("disk:       {} in {}{}", found.line(), directory, note)
    if not opts.ignore_disk_forecast:
        disk_forecast.refuse_if_short(found, directory, fp8)


def zero_embedding_rows(model: str, vocab_size: int) -> frozenset[int]:
    """The target's tokens whose input embedding row is zero (their zero states are the model's own), logged."""
    zero_ids = zero_embedding_ids(model, vocab_size)
    if zero_ids is None:
        logger.info("{}: no safetensors embedding read; the screen exempts no zero row", model)
        return frozenset()
    if zero_ids:
        logger.info(
            "{}: {} tokens have an all-zero input embedding row (e.g. {}): their zero states are the model's own",
            model,
            len(zero_ids),
            sorted(zero_ids)[:5],
        )
    return zero_ids


def _announce(generator, opts: RunConfig, pending: int, done: int, model_args: dict) -> None:
    """The start line: what runs, with the settings that matter (and the engine arguments changing the model)."""
    engine = generator.engine
    s = engine.config
    changed = f"; MODEL CHANGED by --engine-args {arg_kinds.describe(model_args)}" if model_args else ""
    logger.bind(terminal=True).info(
        "{}: layers {} (vLLM aux ids {}), {}, TP {}{}, {} executor, async scheduling {}, {}, "
        "max_num_seqs {}, max_num_batched_tokens {}{}; {} samples to write{}",
        s.model,
        list(generator.plan.layer_ids),
        list(generator.plan.vllm_ids),
        str(engine.dtype).removeprefix("torch.") + (f" (stored as {fp8.NAME})" if s.fp8 else ""),
        s.tensor_parallel_size,
        f" x PP {s.pipeline_parallel_size}" if s.pipeline_parallel_size > 1 else "",
        engine.executor_kind,
        "on" if engine.async_scheduling else "OFF",
        "eager" if s.enforce_eager else "compiled",
        s.max_num_seqs,
        engine.max_num_batched_tokens,
        changed,
        pending,
        f" ({done} already done)" if done else "",
    )


def host_line(host: dict) -> str:
    """Where a run's generation time went on the host: what the engine's thread waited for, and the writers' load."""
    return (
        f"the engine's thread spent {host['engine_stepped']:.1f} s in vLLM's steps, "
        + (
            f"handed rows to the copy thread for {host['engine_copied']:.1f} s (it copied for "
            f"{host['copy_thread']:.1f} s; the engine's thread waited {host['copy_waited']:.1f} s for it)"
            if host.get("copy_thread")
            else f"copied rows for {host['engine_copied']:.1f} s"
        )
        + f" and waited {host['waited']:.1f} s for the writers (queue full); "
        f"{host['workers']} write workers"
        + (" (SCHED_BATCH)" if host.get("batched") else "")
        + f" busy {host['busy']:.0%} of the time"
        + (f" ({host['helped']} files written by their helper processes)" if host.get("helped") else "")
        + (f", {host['drainers']} more for the last samples" if host.get("drainers") else "")
        + (
            f" (on a CPU {host['on_cpu']:.0%} of it, {host['cpu_per_gib']:.2f} CPU-s per GiB written)"
            if host.get("cpu_per_gib")
            else ""
        )
        + _paths(host)
        + _finite_test(host)
        + (f"; {host['rows_placed']:,} prompt rows placed by the worker" if host.get("rows_placed") else "")
        + f"; buffer pool: {host['blocks_made']} "
        f"blocks made, {host['blocks_reused']} reused"
        + (f", {host['samples_fresh']} samples in fresh memory (CPU engine)" if host.get("samples_fresh") else "")
        + (f"; {huge_pages.describe(host['glibc_tunables'])}" if host.get("glibc_tunables") is not None else "")
        + (
            f"; this process{' and its write helpers' if host.get('helped') else ''} used "
            f"{host['cpu_seconds']:.1f} CPU-s (user + system)"
            if "cpu_seconds" in host
            else ""
        )
        + (
            f"; the last files were made durable {host['drain_seconds']:.2f} s after the engine's last sample"
            if host.get("drain_seconds") is not None
            else ""
        )
        + (
            f"; from half to nine tenths of the tokens at {host['mid_run_rate']:,.0f} tokens/s"
            if host.get("mid_run_rate")
            else ""
        )
    )


def _finite_test(host: dict) -> str:
    """Who tested the samples for NaN/Inf: the device as the states left it (GPU staging), or the writers."""
    proven, tested = host.get("finite_proven", 0), host.get("finite_tested", 0)
    if not proven + tested:
        return ""
    return f"; NaN/Inf test: {proven:,} samples proven on the device, {tested:,} tested by the writers"


def _paths(host: dict) -> str:
    """How the files' bytes reached the disk: with O_DIRECT from the samples' memory, through its bounce buffer,
    through the page cache (a file system that refuses O_DIRECT, or keeps its files in memory: tmpfs, ramfs)."""
    total = sum(host.get(k, 0) for k in ("direct", "bounced", "buffered"))
    if not total:
        return ""
    return (
        f"; bytes written with O_DIRECT {host.get('direct', 0) / total:.1%} from the samples' memory, "
        f"{host.get('bounced', 0) / total:.1%} through a bounce buffer, {host.get('buffered', 0) / total:.1%} "
        "through the page cache"
        + (" (the file system refused a direct write: the later files went through it)" if host.get("refused") else "")
        + (
            f" (the folder is on {host['in_memory']}, whose files are memory pages: each chunk copied there, then "
            "hashed from the cache)"
            if host.get("in_memory")
            else ""
        )
    )


def _fresh_below(device_type: str) -> int:
    """The pool's ``fresh_below`` for this process: on a CPU engine whose heap glibc keeps (run/huge_pages.py) none,
    every sample in a reused block (fresh samples among the forward's tensors fragmented the kept heap: its peak
    crept from 5.3 to 5.9 GB over a 256-prompt wide run, against 5.27 flat in blocks); with glibc's own
    thresholds, samples under its mmap ceiling come from (and go back to) the heap; a GPU engine's samples: blocks."""
    if device_type != "cpu" or huge_pages.heap_kept(os.environ.get("GLIBC_TUNABLES", "")):
        return 0
    return MALLOC_MMAP_CEILING


def _cpu_since(before: os.times_result) -> float:
    """CPU seconds (user + system, every thread) used since ``before`` (``os.times()``) by this process and by its
    children that ended meanwhile (the write helpers, reaped when the writer closes)."""
    now = os.times()
    return sum(getattr(now, k) - getattr(before, k) for k in ("user", "system", "children_user", "children_system"))


def _generate(
    generator,
    work,
    pending: np.ndarray,
    directory: Path,
    opts: RunConfig,
    summary: RunSummary,
    progress_to=None,
    cpus=None,
    algorithm: str = checksums.DEFAULT,
    done: dict | None = None,
    zero_ids: frozenset[int] = frozenset(),
    model_args: dict | None = None,
    vocab_size: int | None = None,
    workers_given: bool = False,
) -> None:
    layer_ids = list(generator.plan.layer_ids)
    engine = generator.engine
    checker = _logit_checker(generator, opts) if opts.logit_check_samples > 0 else None
    checked = set(pending[: opts.logit_check_samples].tolist()) if checker is not None and checker.active else set()
    if opts.regenerate:
        work.begin(directory, pending, done or {}, checked.__contains__)
    if checked:
        engine.warm_prompt_logprobs()  # vLLM compiles its prompt-logprobs kernel here, not in the first step
    # each sample's states: one block, back to the pool once its file is written; on a CPU engine, whose forward
    # shares this process's heap, samples under glibc's mmap ceiling come fresh unless the heap is kept (_fresh_below)
    # (shared memory with write helpers: their processes read the states where they lie, speculators_v016.store.write_helper)
    # (with engine.core.PLACE_ROWS, on by default, a GPU engine's worker in this process copies each prompt's rows
    # straight into its block: pinned blocks)
    helpers = write_helpers_used(opts.write_helpers)
    pool = BufferPool(fresh_below=_fresh_below(engine.device_type), align=DATA_ALIGN,
                      shared=helpers, pin=engine.wants_pinned)  # fmt: skip
    stats = engine.stats  # the engine's thread's time, counted from here
    before = (stats.stepped, stats.copied, stats.copy_thread, stats.copy_waited, stats.placed_rows)

    writer = SampleWriter(
        directory,
        opts.format,
        layer_ids,
        workers=opts.write_workers,
        batch=engine.device_type == "cpu",  # SCHED_BATCH: measured faster beside a CPU forward's OpenMP threads
        non_finite=non_finite_reason(layer_ids),
        cpus=cpus,
        checksum=algorithm,
        model_args=model_args,
        screen=WriterScreen(layer_ids, zero_ids),  # the degenerate-row screen, off the engine's thread
        direct=opts.direct_io,
        shared_blocks=pool if helpers else None,
    )
    if engine.device_type != "cpu":  # every sample of a GPU engine is in the pool's shared blocks
        writer.start_helpers()

    # samples whose every state the device proved finite as it left it (GPU staging: StepCapture.finite): the
    # engine's keys, then the samples' names; the writers skip their NaN/Inf test of those
    device_proven: set[int] = set()
    proven_names: set[int] = set()

    def put(name: int, sample: dict, record: dict | None = None) -> None:
        if record is not None:  # on disk before the sample can be listed (speculators_v016.store.regenerated)
            work.journal.append(record)
        block = fp8.tensors_of(sample["hidden_states"])  # FP8: codes and scales, one block
        finite = name in proven_names
        proven_names.discard(name)
        writer.put(name, sample, done=lambda: pool.give_back(block), finite=finite)

    # every finished sample waits here until the logit check has judged all of its samples
    hold = HoldBack(checked, checker, layer_ids, put, zero_ids, writer_screens=True)

    window = max(opts.batch_size, 2 * opts.engine.max_num_seqs)
    total_tokens = work.tokens(pending)  # None: a regenerating run's, not known before the target writes them
    started, cpu_before = time.monotonic(), os.times()
    streamed = None  # s from the clock's start to the engine's last sample (the rest: the last files' writes)
    # the forward's progress when the samples handed over pass half and nine tenths (prefill runs: their samples
    # are the pending rows; a regenerating run's turns are not known before the target writes them)
    marks = MidRun(None if opts.regenerate else len(pending), started)
    before_marks = stats.computed, stats.steps  # the engine's count before the clock (a warm-up's, where none reset)
    handed = 0
    by_samples = total_tokens is None  # then the bar counts samples (its ETA), the tokens go in its postfix
    bar = tqdm(
        total=len(pending) if by_samples else total_tokens,
        unit="sample" if by_samples else "tok",
        unit_scale=not by_samples,
        disable=not opts.progress or progress_to is None,
        desc=f"0/{len(pending)} samples",
        dynamic_ncols=True,
        file=progress_to,
        mininterval=1.0,
    )
    take_dropped = getattr(work, "take_dropped", None)  # a prefill run's rows dropped after tokenizing
    try:
        feed = work.feed(pending) if opts.regenerate else _checked_ids(work.feed(pending), vocab_size, opts)
        want = checked.__contains__ if checked else None
        stream = engine.stream(
            feed, window=window, prompt_logprobs=want, allocate=pool.take, proven=device_proven, pinned=pool.pin
        )
        for index, ids, states in stream:
            theirs = engine.prompt_logprobs.pop(index, None) if index in checked else None
            name = index + opts.start_idx
            finite = index in device_proven
            device_proven.discard(index)
            input_ids = torch.tensor(ids, dtype=torch.long)
            mask, record, sampled_logprobs = work.finish(index, ids, engine)
            if mask is None:  # a turn folded into its conversation's next sample: journaled, its states not kept
                _fold(index, record, work, hold, checked, states, pool)
                bar.update(1)
                continue
            if theirs is not None and sampled_logprobs is not None:  # log p of every token after the first
                theirs = torch.cat([theirs.float(), torch.tensor(sampled_logprobs, dtype=torch.float32)])
            hold.judge(index, name, input_ids, states, theirs)
            sample = {"input_ids": input_ids, "hidden_states": states, "loss_mask": mask}
            if finite:
                proven_names.add(name)
            hold.admit(index, name, sample, record)
            summary.tokens += len(ids)
            handed += 1
            marks.passed(handed, stats.computed - before_marks[0], stats.steps - before_marks[1])
            bar.update((1 + (take_dropped() if take_dropped else 0)) if by_samples else len(ids))
            if by_samples:
                bar.set_postfix_str(f"{summary.tokens / max(time.monotonic() - started, 1e-9):,.0f} tok/s", False)
            cut = work.take_cut()
            _note_cut(cut, summary, opts)
            hold.forget(i for i, _ in cut)  # a checked turn that will never come is not waited for
            _note_rejected(writer.take_rejected(), summary, opts)
            bar.set_description(f"{writer.written}/{len(pending)} samples")
        streamed = time.monotonic() - started
        _note_cut(work.take_cut(), summary, opts)  # turns cut after the last sample came
        if by_samples and take_dropped:
            bar.update(take_dropped())  # rows dropped after the last sample came
        hold.finish()
    finally:
        try:
            # the samples still queued are written and made durable, inside the clock; the engine is done, so
            # up to three quarters of the cores write them (one more thread per queued sample), unless the user
            # gave --write-workers
            writer.close(drain_workers=last_samples_threads(len(cpus or ()), opts.write_workers, workers_given))
            summary.generation_seconds = time.monotonic() - started
            if opts.regenerate:
                work.end(directory, set(Manifest(directory).entries()))
                summary.regenerated = dict(work.finish_reasons)
                summary.conversations = work.shapes
                summary.stopped = work.stops
        finally:
            try:
                pool.close()  # first: nothing below may leave its pinned blocks registered past the run
            finally:
                summary.generation_seconds = summary.generation_seconds or time.monotonic() - started
                summary.written, summary.bytes = writer.written, writer.bytes
                host = {**writer.load(), "engine_stepped": stats.stepped - before[0], "engine_copied": stats.copied - before[1],
                        "copy_thread": stats.copy_thread - before[2], "copy_waited": stats.copy_waited - before[3],
                        "rows_placed": stats.placed_rows - before[4],
                        "blocks_made": pool.allocated, "blocks_reused": pool.reused,
                        "samples_fresh": pool.fresh, "cpu_seconds": _cpu_since(cpu_before),
                        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "") if engine.device_type == "cpu" else None,
                        "drain_seconds": summary.generation_seconds - streamed if streamed is not None else None,
                        "mid_run_rate": marks.rate()}  # fmt: skip
                summary.host = {k: round(v, 3) if isinstance(v, float) else v for k, v in host.items()}
                bar.set_description(f"{writer.written}/{len(pending)} samples")
                bar.close()
    _note_rejected(writer.take_rejected(), summary, opts)
    if summary.non_finite:
        summary.skipped["NaN/Inf hidden states"] = len(summary.non_finite)
    if checker is not None:
        summary.logit_check = {"ok": not checker.result.failures, "line": checker.result.line()}


def _checked_ids(feed, vocab_size: int | None, opts: RunConfig):
    """The feed, each sample's ids checked against the target's vocabulary before the engine takes them."""
    for index, ids in feed:
        if vocab_size is not None:
            check_token_ids(f"sample {index}", ids, vocab_size, f" of {opts.engine.model}")
        yield index, ids


def checksum_of_run(directory: Path, existing: dict | None, done: dict, asked: str | None) -> str:
    """The manifest digest this run writes: a folder keeps the algorithm of the entries it holds.

    ``existing``: the folder's ``data_config.json`` (None: a new folder); one
    without a ``checksum`` field was written by an earlier release, with
    sha256. ``asked`` (``--checksum``; None when not given) that differs from
    a folder with entries is refused naming both: a user who asks for sha256
    because their tooling wants it must not get a folder of BLAKE3 digests.
    """
    if existing is None or not done:  # nothing listed yet: this run decides
        return asked or checksums.DEFAULT
    held = existing.get("speculators_v016", {}).get("checksum", checksums.LEGACY)
    listed = sorted({e.algorithm for e in done.values()})
    if listed != [held]:
        raise run_config.ResumeMismatchError(
            f"{directory}: manifest.jsonl lists {' and '.join(listed)} digests, data_config.json says {held}: "
            "not a folder this tool wrote as it is; use another --output-dir"
        )
    if asked is not None and asked != held:
        raise run_config.ResumeMismatchError(
            f"{directory} holds {len(done)} samples listed with {held} digests; this run asks for --checksum "
            f"{asked}. A folder keeps one algorithm: resume without --checksum (or with --checksum {held}), "
            "or use another --output-dir"
        )
    if held != checksums.DEFAULT:
        logger.bind(terminal=True).info(
            "resuming a folder of {} digests: its new samples are listed with {} too", held, held
        )
    return held


def _fold(index: int, record: dict, work, hold: HoldBack, checked: set, states, pool: BufferPool) -> None:
    """Turn ``index`` is folded into the sample of its conversation's next turn (``--regenerate-samples auto``):
    its record goes to the journal (a resume takes its tokens from there), its states back to the pool (the next
    turn's prefill computes them again, for the same prefix), and a logit check it was to pass falls to the next
    turn, whose prompt holds it."""
    work.journal.append(record)
    pool.give_back(fp8.tensors_of(states))
    if index in checked:
        checked.discard(index)
        checked.add(index + 1)  # the same conversation's next turn: a folded turn is never its last
        hold.hand_over(index, index + 1)


def _note_cut(cut: list, summary: RunSummary, opts: RunConfig) -> None:
    """Turns --regenerate had no room for: named in the log, counted in the summary (verify counts them)."""
    for cut_index, why in cut:
        logger.warning("sample {}: not generated: {}", cut_index + opts.start_idx, why)
        reason = not_generated(why)
        summary.skipped[reason] = summary.skipped.get(reason, 0) + 1


def _cut_why(cut: list, opts: RunConfig) -> str:
    """Why the turns not written cannot be generated (a finished run run again)."""
    reasons = {not_generated(why) for _, why in cut}
    whys = ["follow a tool call other than the source's (their conversation stopped there)"] * (STOPPED in reasons)
    whys += [f"have no room under --seq-length {opts.seq_length}"] * (NOT_GENERATED in reasons)
    return " or ".join(whys)


def _note_rejected(rejected: list, summary: RunSummary, opts: RunConfig) -> None:
    """Samples the writer did not write because of NaN/Inf states: named, counted, and the limit enforced."""
    for index, (layers, tokens) in rejected:
        summary.non_finite.append({"index": index, "layers": layers})
        summary.tokens -= tokens
        logger.error("sample {}: NaN/Inf hidden states in layers {}: not written", index, layers)
    if len(summary.non_finite) > opts.max_bad_samples:
        raise NonFiniteError(
            f"{len(summary.non_finite)} samples with NaN/Inf hidden states "
            f"(limit --max-bad-samples {opts.max_bad_samples}); first: {summary.non_finite[0]}"
        )


def _logit_checker(generator, opts: RunConfig):
    """The logit check of this run, if the last layer is captured (see speculators_v016.checks.logit_check)."""
    return LogitChecker(opts.engine.model, generator.engine.dtype, generator.plan.last_layer_index)


def _save_token_counts(counts, path: str) -> None:
    """Upstream's token_freq.pt (trainable-token counts; an existing file is kept), write errors named."""
    try:
        prefill.save_token_counts(counts, path)
    except OSError as exc:
        raise WriteError(exc.errno, f"cannot write --token-freq-path {path}: {exc.strerror or exc}") from exc
    except RuntimeError as exc:  # torch.save reports a failed write so
        if "write" not in str(exc).lower():
            raise
        raise WriteError(errno.EIO, f"cannot write --token-freq-path {path}: {exc}") from exc


def _save_token_frequencies_of(records, path: str) -> None:
    """Upstream's token_freq.pt of a regenerating run: the generated (trainable) tokens of its samples."""
    counts = Counter()
    for record in records:
        counts.update(record["token_ids"])
    _save_token_counts(counts, path)


def _new_config(generator, opts: RunConfig, samples, fp: dict, shard_samples: int) -> dict:
    from speculators.data_generation.config_generator import (  # noqa: PLC0415 - upstream is slow to import
        DataGenerationConfig,
    )

    config = DataGenerationConfig.from_generator(
        generator=generator,
        train_data_path=list(opts.train_data_path),
        seq_length=opts.seq_length,
        cache_dir=str(opts.hf_cache_dir or ""),
        num_samples=samples.count,
        max_samples=opts.max_samples,
        seed=opts.seed,
    ).to_dict()
    config["speculators_v016"] = {
        "version": speculators_v016.__version__,
        "layers": generator.layer_mapping,
        "format": opts.format,
        "dtype": str(generator.engine.dtype).removeprefix("torch."),
        "hidden_states_dtype": opts.engine.hidden_states_dtype,
        "checksum": opts.checksum or checksums.DEFAULT,  # of manifest.jsonl's digests (speculators_v016.store.checksum)
        "target_quantization": generator.quantization,  # None: unquantized
        "start_idx": opts.start_idx,
        "shard": {"index": opts.shard_index, "count": opts.num_shards, "samples": shard_samples},
        "dataset_samples": samples.count,  # a prefill run: the names of the run's order (some may be gaps)
        # what the trainer should know: the engine arguments that changed the model ({}: none); each header too
        MODEL_ARGS_KEY: arg_kinds.model_changing(opts.engine.extra_engine_args, vllm_defaults()),
        "fingerprint": fp,
    }
    if opts.regenerate:
        config["speculators_v016"]["regenerate"] = samples.describe()
    else:
        config["speculators_v016"]["numbering"] = prefill.NUMBERING
    if opts.engine.fp8:
        config["speculators_v016"]["hidden_states_scaling"] = fp8.SCALING
        schema = config["format"]["schema"]
        schema["hidden_states"]["dtype"] = "list[torch.float8_e4m3fn]"
        schema["hidden_states"]["description"] += " (e4m3 codes: value = code * hidden_states_scale)"
        schema["hidden_states_scale"] = {
            "dtype": "list[torch.float32]",
            "shape": "list of [seq_len]",
            "num_tensors": len(generator.layer_ids),
            "description": "One scale per token per layer (amax/448; 1 for a zero row)",
        }
    return config
