"""One data-generation run: dataset -> samples -> engine -> verified files.

The steps, each owned by a module: :mod:`~speculators_v016.dataset`
(rows to token samples), :mod:`~speculators_v016.outdir` (folder, lock),
:mod:`~speculators_v016.run_config` (fingerprint, resume check,
``data_config.json``), :mod:`~speculators_v016.engine` (hidden states, streamed),
:mod:`~speculators_v016.writer` and :mod:`~speculators_v016.manifest`
(atomic files, then their manifest lines).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from loguru import logger
from tqdm import tqdm

from speculators_v016 import faults, run_config
from speculators_v016.dataset import PreparedSamples, prepare_samples
from speculators_v016.engine import PromptError
from speculators_v016.manifest import Manifest
from speculators_v016.outdir import OutputDir, shard_dir
from speculators_v016.sample_format import parse_sample_name
from speculators_v016.writer import SampleWriter


class NonFiniteError(RuntimeError):
    """Too many samples had NaN or Inf hidden states."""


@dataclass
class RunOptions:
    target_model_path: str
    train_data_path: list[str]
    output_dir: Path
    seq_length: int = 2048
    max_samples: int | None = None
    layer_ids: list[int] | None = None
    batch_size: int = 8
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.8
    token_freq_path: str = "./token_freq.pt"
    hf_cache_dir: str | None = None
    assistant_pattern: str | None = None
    turn_dropout: bool = False
    seed: int = 0
    start_idx: int = 0
    num_preprocessing_workers: int = 8
    # ours
    format: str = "safetensors"
    num_shards: int = 1
    shard_index: int = 0
    trust_remote_code: bool = False
    skip_bad_rows: bool = False
    max_bad_samples: int = 10
    dtype: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    executor: str | None = None
    write_workers: int = 2
    logit_check_samples: int = 4
    progress: bool = True
    deep_verify: bool = False


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

    def lines(self) -> list[str]:
        rate = self.tokens / self.generation_seconds if self.generation_seconds else 0.0
        out = [f"output:     {self.output_dir}",
               f"written:    {self.written} samples ({self.already_done} already done before this run)",
               f"tokens:     {self.tokens} in {self.generation_seconds:.1f} s of generation "
               f"({rate:,.0f} tokens/s; {self.seconds:.1f} s in all)",
               f"bytes:      {self.bytes:,}",
               f"truncated:  {self.truncated} (to --seq-length; loss masks cut alongside)"]
        out += [f"skipped:    {n} {reason}" for reason, n in sorted(self.skipped.items())] or ["skipped:    0"]
        if self.logit_check:
            out.append(f"logit check: {self.logit_check['line']}")
        return out


def fingerprint(opts: RunOptions, samples: PreparedSamples, layer_ids: list[int]) -> dict:
    return {
        "model": run_config.model_fingerprint(opts.target_model_path),
        "dataset": {"sources": samples.sources, "kind": samples.kind},
        "preprocessing": {"seq_length": opts.seq_length, "max_samples": opts.max_samples, "seed": opts.seed,
                          "assistant_pattern": opts.assistant_pattern, "turn_dropout": opts.turn_dropout},
        "generation": {"layer_ids": layer_ids, "format": opts.format, "dtype": opts.dtype,
                       "start_idx": opts.start_idx, "num_shards": opts.num_shards,
                       "shard_index": opts.shard_index},
    }


def completed(directory: Path, manifest: Manifest) -> dict:
    """Manifest entries whose files are in place with the recorded size (the rest is redone)."""
    entries = manifest.entries()
    good = {i: e for i, e in entries.items()
            if (directory / e.file).is_file() and (directory / e.file).stat().st_size == e.bytes}
    torn = manifest.path.exists() and not manifest.path.read_text().endswith("\n") and entries
    if len(good) != len(entries) or torn:
        manifest.compact(good)
    return good


def run(opts: RunOptions, progress_to=None) -> RunSummary:
    """Make the samples of ``opts``; a progress bar goes to ``progress_to`` (a text stream) if given."""
    from transformers import AutoTokenizer

    from speculators_v016.generator import VllmHiddenStatesGenerator, num_decoder_layers
    from speculators_v016.layers import LayerPlan

    started = time.monotonic()
    directory = shard_dir(Path(opts.output_dir), opts.shard_index, opts.num_shards)
    plan = LayerPlan.build(num_decoder_layers(opts.target_model_path, opts.trust_remote_code), opts.layer_ids)
    summary = RunSummary(str(directory))
    with OutputDir(directory) as out:
        if out.removed_leftovers:
            logger.warning("removed {} temporary files left by an interrupted run", len(out.removed_leftovers))
        tokenizer = AutoTokenizer.from_pretrained(opts.target_model_path, trust_remote_code=opts.trust_remote_code)
        samples = prepare_samples(
            opts.train_data_path, tokenizer, opts.seq_length, max_samples=opts.max_samples, seed=opts.seed,
            num_proc=opts.num_preprocessing_workers, assistant_pattern=opts.assistant_pattern,
            turn_dropout=opts.turn_dropout, hf_cache_dir=opts.hf_cache_dir, skip_bad_rows=opts.skip_bad_rows)
        summary.skipped, summary.truncated = dict(samples.skipped), samples.truncated
        if not len(samples):
            raise PromptError(f"no usable sample in {opts.train_data_path} (skipped: {dict(samples.skipped)})")
        fp = fingerprint(opts, samples, list(plan.layer_ids))
        has_samples = any(parse_sample_name(p.name) for p in directory.iterdir())
        existing = run_config.check_resume(directory, fp, has_samples)
        manifest = Manifest(directory)
        done = completed(directory, manifest)
        mine = [i for i in range(len(samples)) if i % opts.num_shards == opts.shard_index]
        pending = [i for i in mine if i + opts.start_idx not in done]
        summary.already_done = len(mine) - len(pending)
        if opts.token_freq_path:
            _save_token_frequencies(samples, opts.token_freq_path)
        if not pending:
            logger.info("all {} samples of this shard are already written", len(mine))
            summary.seconds = time.monotonic() - started
            return summary
        _check_vocabulary(samples, pending, tokenizer, opts)
        generator = VllmHiddenStatesGenerator(
            opts.target_model_path, layer_ids=plan.layer_ids, max_model_len=opts.seq_length + 1,
            gpu_memory_utilization=opts.gpu_memory_utilization, tensor_parallel_size=opts.tensor_parallel_size,
            dtype=opts.dtype, enforce_eager=opts.enforce_eager, async_scheduling=opts.async_scheduling,
            max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
            trust_remote_code=opts.trust_remote_code, seed=opts.seed, executor=opts.executor)
        try:
            config = existing or _new_config(generator, opts, samples, fp, len(mine))
            run_config.save(directory, config)
            _announce(generator, opts, len(pending), summary.already_done)
            _generate(generator, samples, pending, directory, opts, summary, progress_to)
        finally:
            generator.shutdown()
        summary.seconds = time.monotonic() - started
        config["speculators_v016"]["last_run"] = asdict(summary)
        run_config.save(directory, config)
    return summary


def _announce(generator, opts: RunOptions, pending: int, done: int) -> None:
    """The start line: what runs, with the settings that matter."""
    engine = generator.engine
    s = engine.settings
    executor = {"UniProcExecutor": "uni", "MultiprocExecutor": "mp", "RayDistributedExecutor": "ray"}.get(
        type(engine.executor).__name__.removeprefix("Capture"), type(engine.executor).__name__)
    logger.bind(terminal=True).info(
        "{}: layers {} (vLLM aux ids {}), {}, TP {}, {} executor, async scheduling {}, {}, "
        "max_num_seqs {}, max_num_batched_tokens {}; {} samples to write{}",
        opts.target_model_path, list(generator.plan.layer_ids), list(generator.plan.vllm_ids),
        str(engine.dtype).removeprefix("torch."), s.tensor_parallel_size, executor,
        "on" if engine.async_scheduling else "OFF", "eager" if s.enforce_eager else "compiled",
        s.max_num_seqs, engine.scheduler.scheduler_config.max_num_batched_tokens, pending,
        f" ({done} already done)" if done else "")


def _generate(generator, samples: PreparedSamples, pending: list[int], directory: Path, opts: RunOptions,
              summary: RunSummary, progress_to=None) -> None:
    layer_ids = list(generator.plan.layer_ids)
    writer = SampleWriter(directory, opts.format, layer_ids, workers=opts.write_workers)
    window = max(opts.batch_size, 2 * opts.max_num_seqs)
    checked = set(pending[: opts.logit_check_samples])
    checker = _logit_checker(generator, opts) if checked else None
    engine = generator.engine
    total_tokens = sum(len(samples.input_ids[i]) for i in pending)
    started = time.monotonic()
    bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, disable=not opts.progress or progress_to is None,
               desc=f"0/{len(pending)} samples", dynamic_ncols=True, file=progress_to, mininterval=1.0)
    try:
        feed = ((i, samples.input_ids[i]) for i in pending)
        for index, ids, states in engine.stream(feed, window=window, prompt_logprobs=checked.__contains__):
            theirs = engine.prompt_logprobs.pop(index, None) if index in checked else None
            if theirs is not None and checker is not None and checker.active:
                seen = list(states)
                if faults.armed_value("shift-check"):  # fault injection (tests only): rows one position off
                    seen[checker.last] = torch.roll(seen[checker.last], 1, 0)
                if checker.add(index, torch.tensor(ids), seen, theirs) > checker.result.tolerance:
                    logger.error("sample {}: the captured last layer does not reproduce vLLM's own logits "
                                 "(logit check)", index + opts.start_idx)
                if checker.result.samples == len(checked):
                    checker.release()
            if faults.armed_value("nan-sample"):  # fault injection (tests only)
                states[-1][len(ids) // 2, 0] = float("nan")
            bad = [layer for layer, h in zip(layer_ids, states) if not torch.isfinite(h).all()]
            if bad:
                summary.non_finite.append({"index": index + opts.start_idx, "layers": bad})
                logger.error("sample {}: NaN/Inf hidden states in layers {}: not written",
                             index + opts.start_idx, bad)
                if len(summary.non_finite) > opts.max_bad_samples:
                    raise NonFiniteError(f"{len(summary.non_finite)} samples with NaN/Inf hidden states "
                                         f"(limit --max-bad-samples {opts.max_bad_samples}); first: "
                                         f"{summary.non_finite[0]}")
                continue
            mask = torch.tensor(samples.loss_masks[index][: len(ids)], dtype=torch.long)
            writer.put(index + opts.start_idx, {"input_ids": torch.tensor(ids, dtype=torch.long),
                                                "hidden_states": states, "loss_mask": mask})
            summary.tokens += len(ids)
            bar.update(len(ids))
            bar.set_description(f"{writer.written}/{len(pending)} samples")
    finally:
        summary.generation_seconds = time.monotonic() - started
        try:
            writer.close()
        finally:
            summary.written, summary.bytes = writer.written, writer.bytes
            bar.set_description(f"{writer.written}/{len(pending)} samples")
            bar.close()
    if summary.non_finite:
        summary.skipped["NaN/Inf hidden states"] = len(summary.non_finite)
    if checker is not None:
        summary.logit_check = {"ok": not checker.result.failures, "line": checker.result.line()}


def _logit_checker(generator, opts: RunOptions):
    """The logit check of this run, if the last layer is captured (see speculators_v016.logit_check)."""
    from speculators_v016.logit_check import LogitChecker

    layers = list(generator.plan.layer_ids)
    last = layers.index(generator.plan.num_layers - 1) if generator.plan.num_layers - 1 in layers else None
    return LogitChecker(opts.target_model_path, generator.engine.dtype, last)


def _check_vocabulary(samples: PreparedSamples, pending: list[int], tokenizer, opts: RunOptions) -> None:
    """Pre-tokenized ids outside the target's vocabulary fail before the engine starts."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(opts.target_model_path, trust_remote_code=opts.trust_remote_code)
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 0)
    for i in pending:
        bad = [t for t in samples.input_ids[i] if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"sample {i} has token ids outside the vocabulary of "
                              f"{opts.target_model_path} [0, {vocab}): {bad[:5]}")


def _save_token_frequencies(samples: PreparedSamples, path: str) -> None:
    """Upstream's token_freq.pt (its own function: trainable-token counts; an existing file is kept)."""
    import datasets
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    table = datasets.Dataset.from_dict({"input_ids": samples.input_ids, "loss_mask": samples.loss_masks})
    table.set_format(type="torch")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_token_frequency_distribution(table, path)


def _new_config(generator, opts: RunOptions, samples: PreparedSamples, fp: dict, shard_samples: int) -> dict:
    from speculators.data_generation.config_generator import DataGenerationConfig

    import speculators_v016

    config = DataGenerationConfig.from_generator(
        generator=generator, train_data_path=opts.train_data_path, seq_length=opts.seq_length,
        cache_dir=str(opts.hf_cache_dir or ""), num_samples=len(samples), max_samples=opts.max_samples,
        seed=opts.seed).to_dict()
    config["speculators_v016"] = {
        "version": speculators_v016.__version__,
        "layers": generator.layer_mapping,
        "format": opts.format,
        "dtype": str(generator.engine.dtype).removeprefix("torch."),
        "target_quantization": generator.quantization,  # None: unquantized
        "start_idx": opts.start_idx,
        "shard": {"index": opts.shard_index, "count": opts.num_shards, "samples": shard_samples},
        "dataset_samples": len(samples),
        "fingerprint": fp,
    }
    return config
