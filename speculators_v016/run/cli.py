"""``speculators-data-gen``: a dataset in, verified EAGLE-3 training files out.

Accepts the options of upstream speculators 0.3.0's
``scripts/data_generation_offline.py`` with the same names and meanings, so
launch scripts switch by changing the command name; adds resumable, sharded,
atomic output and the ``verify``, ``check``, ``demo`` and ``clean-shm`` subcommands.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import click

from speculators_v016.exit_codes import ExitCode, help_text
from speculators_v016.settings import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_LOGIT_CHECK_SAMPLES,
    DEFAULT_MAX_BAD_SAMPLES,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREPROCESSING_WORKERS,
    DEFAULT_SEQ_LENGTH,
    DEFAULT_TOKEN_FREQ_PATH,
    DEFAULT_WRITE_WORKERS,
    EXECUTORS,
    HIDDEN_STATES_DTYPES,
    MIN_DEFAULT_BATCHED_TOKENS,
)

ENV_PREFIX = "SPECULATORS_DATA_GEN"
EXIT_CODES = f"""\b
{help_text()}
Every option can also be set from the environment, e.g.
SPECULATORS_DATA_GEN_TARGET_MODEL_PATH, SPECULATORS_DATA_GEN_OUTPUT_DIR."""


def _env_int(names: tuple[str, ...], minimum: int) -> int | None:
    """The first of the launcher variables ``names`` that is set, as an integer >= ``minimum``; usage error if not."""
    for name in names:
        value = os.environ.get(name)
        if value:
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is None or number < minimum:
                raise click.UsageError(
                    f"environment variable {name}={value!r} is not a whole number >= {minimum} "
                    "(launchers such as torchrun and SLURM set it; or give --num-shards and "
                    "--shard-index)"
                )
            return number
    return None


def _shard_defaults(num_shards: int | None, shard_index: int | None) -> tuple[int, int]:
    """--num-shards/--shard-index, else a launcher's RANK/WORLD_SIZE (torchrun) or SLURM's."""
    if num_shards is None:
        num_shards = _env_int(("WORLD_SIZE", "SLURM_NTASKS"), 1) or 1
    if shard_index is None:
        shard_index = (_env_int(("RANK", "SLURM_PROCID"), 0) or 0) if num_shards > 1 else 0
    if not 0 <= shard_index < num_shards:
        raise click.BadParameter(f"shard index {shard_index} is not in [0, {num_shards})", param_hint="--shard-index")
    return num_shards, shard_index


def _layer_ids(value: str | None) -> list[int] | None:
    """None when the option is absent; an empty or negative value is a usage error (never the default)."""
    if value is None:
        return None
    try:
        ids = [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: give integers, e.g. --layer-ids 2 16 29 31", param_hint="--layer-ids"
        ) from None
    if not ids:
        raise click.BadParameter(
            "no layer id given (an empty value, e.g. an unset variable?); give ids such as "
            "--layer-ids 2 16 29 31, or leave the option out for the default layers",
            param_hint="--layer-ids",
        )
    negative = [i for i in ids if i < 0]
    if negative:
        raise click.BadParameter(
            f"{negative} negative: id L is the output of decoder layer L, from 0 to n-1 "
            "(the last layer); ids counted from the end are not accepted, give n-1 itself",
            param_hint="--layer-ids",
        )
    return ids


@click.group(
    invoke_without_command=True,
    epilog=EXIT_CODES,
    context_settings={
        "auto_envvar_prefix": ENV_PREFIX,
        "show_default": True,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@click.option("--target-model-path", help="Target model: local folder or hub id (what vLLM loads).")
@click.option(
    "--train-data-path",
    multiple=True,
    help="Dataset: .json/.jsonl file (ShareGPT 'conversations', 'messages', or pre-tokenized "
    "'input_ids'+'loss_mask' rows) or a dataset name upstream knows (sharegpt, ultrachat). "
    "Repeat to combine.",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the samples; an interrupted run resumes in it.",
)
@click.option(
    "--seq-length",
    type=click.IntRange(min=1),
    default=DEFAULT_SEQ_LENGTH,
    help="Longest sample in tokens; longer ones are truncated.",
)
@click.option(
    "--max-samples", type=click.IntRange(min=1), default=None, help="Use at most this many rows (after shuffling)."
)
@click.option(
    "--layer-ids",
    default=None,
    help="Layers to capture: id L = output of decoder layer L, before the final norm "
    "(upstream's meaning), 0 to n-1. Space- or comma-separated. Default: 2, n//2, n-3, n-1.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=DEFAULT_BATCH_SIZE,
    help="Prompts admitted ahead of the engine (at least 2 x max-num-seqs).",
)
@click.option(
    "--tensor-parallel-size",
    type=click.IntRange(min=1),
    default=None,
    help="GPUs per model. Default: all visible GPUs, or 1.",
)
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    default=DEFAULT_GPU_MEMORY_UTILIZATION,
    help="vLLM's GPU memory fraction.",
)
@click.option("--token-freq-path", default=DEFAULT_TOKEN_FREQ_PATH, help="Where upstream's token frequency file goes.")
@click.option("--hf-cache-dir", default=None, help="Cache folder for hub datasets.")
@click.option("--assistant-pattern", default=None, help="Regex of assistant spans (default: from the chat template).")
@click.option("--turn-dropout", is_flag=True, help="Keep a random number of leading turns per conversation.")
@click.option("--seed", type=int, default=0, help="Shuffle (and turn dropout) seed.")
@click.option(
    "--start-idx", type=click.IntRange(min=0), default=0, help="Offset added to every sample index in file names."
)
@click.option(
    "--num-preprocessing-workers",
    type=click.IntRange(min=1),
    default=DEFAULT_PREPROCESSING_WORKERS,
    help="Processes for tokenization.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "pt"]),
    default="safetensors",
    help="safetensors (no pickle), or pt: upstream's data_{i}.pt layout for stock trainers.",
)
@click.option(
    "--num-shards",
    type=click.IntRange(min=1),
    default=None,
    help="Split samples over this many runs (default: WORLD_SIZE).",
)
@click.option(
    "--shard-index", type=click.IntRange(min=0), default=None, help="Which shard this run writes (default: RANK)."
)
@click.option("--trust-remote-code", is_flag=True, help="Allow the model folder's own Python code to run.")
@click.option("--skip-bad-rows", is_flag=True, help="Skip (and count) malformed dataset rows instead of failing.")
@click.option(
    "--max-bad-samples",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_BAD_SAMPLES,
    help="Abort after more samples than this with NaN/Inf states.",
)
@click.option("--dtype", default="auto", help="vLLM dtype (auto = the checkpoint's; on CPU auto means bfloat16).")
@click.option(
    "--hidden-states-dtype",
    type=click.Choice(HIDDEN_STATES_DTYPES),
    default="auto",
    help="How states are stored: auto = the engine's dtype; fp8_e4m3 = e4m3 codes + one float32 scale "
    "per token per layer, quantized in the capture (half the bytes; safetensors only).",
)
@click.option("--enforce-eager", is_flag=True, help="Skip torch.compile / CUDA graphs (faster start, slower run).")
@click.option("--sync-scheduling", is_flag=True, help="Turn vLLM's async scheduling off (one step in flight).")
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=DEFAULT_MAX_NUM_SEQS, help="Prompts per engine step at most."
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=None,
    help=f"Tokens per engine step (default: max({MIN_DEFAULT_BATCHED_TOKENS}, seq-length+1)).",
)
@click.option(
    "--executor",
    type=click.Choice(EXECUTORS),
    default=None,
    help="vLLM executor (default: vLLM's choice: uni for one device, mp for tensor parallelism).",
)
@click.option(
    "--write-workers", type=click.IntRange(min=1), default=DEFAULT_WRITE_WORKERS, help="Threads writing sample files."
)
@click.option(
    "--logit-check-samples",
    type=click.IntRange(min=0),
    default=DEFAULT_LOGIT_CHECK_SAMPLES,
    help="Samples whose captured last layer, normed and projected, must reproduce vLLM's own prompt "
    "logprobs (needs only the final norm and lm_head; 0: off).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--deep-verify",
    is_flag=True,
    help="After the run, re-read every file of the folder (sha256, shapes, NaN), not just the manifest.",
)
@click.option(
    "--log-level",
    default="INFO",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Our messages kept in the log file.",
)
@click.option("-v", "--verbose", is_flag=True, help="Everything on the terminal (vLLM, torch, workers), no log file.")
@click.option("-q", "--quiet", is_flag=True, help="Only the summary and errors on the terminal.")
@click.version_option(package_name="speculators-v016", message="%(prog)s %(version)s")
@click.pass_context
def cli(
    ctx,
    target_model_path,
    train_data_path,
    output_dir,
    seq_length,
    max_samples,
    layer_ids,
    batch_size,
    tensor_parallel_size,
    gpu_memory_utilization,
    token_freq_path,
    hf_cache_dir,
    assistant_pattern,
    turn_dropout,
    seed,
    start_idx,
    num_preprocessing_workers,
    fmt,
    num_shards,
    shard_index,
    trust_remote_code,
    skip_bad_rows,
    max_bad_samples,
    dtype,
    hidden_states_dtype,
    enforce_eager,
    sync_scheduling,
    max_num_seqs,
    max_num_batched_tokens,
    executor,
    write_workers,
    logit_check_samples,
    no_progress,
    deep_verify,
    log_level,
    verbose,
    quiet,
):
    """Generate EAGLE-3 training data: hidden states of a target model, one file per sample.

    \b
    speculators-data-gen --target-model-path M --train-data-path data.jsonl --output-dir out/
    speculators-data-gen verify out/          # every file intact and complete?
    speculators-data-gen check --target-model-path M --train-data-path data.jsonl
    speculators-data-gen demo                 # the whole pipeline on a tiny local model
    speculators-data-gen clean-shm            # shared memory that killed runs left

    Layer ids mean what upstream speculators means: id L is the output of decoder
    layer L before the final norm. A draft trained on the data must be served by
    vLLM with eagle_aux_hidden_state_layer_ids = [L+1 for all but the last id];
    data_config.json records both.
    """
    if verbose and quiet:
        raise click.UsageError("--verbose and --quiet exclude each other")
    ctx.obj = {"mode": "verbose" if verbose else "quiet" if quiet else "normal", "log_level": log_level}
    if ctx.invoked_subcommand is not None:
        return
    missing = [
        name
        for name, value in (
            ("--target-model-path", target_model_path),
            ("--train-data-path", train_data_path),
            ("--output-dir", output_dir),
        )
        if not value
    ]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or a subcommand: verify, check, demo, clean-shm)")
    shards, index = _shard_defaults(num_shards, shard_index)
    layers = _layer_ids(layer_ids)
    from speculators_v016.run.pipeline import RunOptions
    from speculators_v016.settings import EngineSettings
    from speculators_v016.store.outdir import shard_name

    if hidden_states_dtype != "auto" and fmt != "safetensors":
        raise click.BadParameter(
            f"--hidden-states-dtype {hidden_states_dtype} is stored as safetensors only: "
            f"upstream's .pt readers would take the FP8 codes for values (--format {fmt})",
            param_hint="--format",
        )
    if tensor_parallel_size is None:
        import torch

        tensor_parallel_size = max(1, torch.cuda.device_count())
    engine = EngineSettings(
        model=target_model_path,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=seq_length + 1,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=gpu_memory_utilization,
        async_scheduling=not sync_scheduling,
        enforce_eager=enforce_eager,
        dtype=dtype,
        executor=executor,
        trust_remote_code=trust_remote_code,
        seed=seed,
        hidden_states_dtype=hidden_states_dtype,
    )
    opts = RunOptions(
        engine=engine,
        train_data_path=list(train_data_path),
        output_dir=output_dir,
        seq_length=seq_length,
        max_samples=max_samples,
        layer_ids=layers,
        batch_size=batch_size,
        token_freq_path=token_freq_path,
        hf_cache_dir=hf_cache_dir,
        assistant_pattern=assistant_pattern,
        turn_dropout=turn_dropout,
        seed=seed,
        start_idx=start_idx,
        num_preprocessing_workers=num_preprocessing_workers,
        format=fmt,
        num_shards=shards,
        shard_index=index,
        skip_bad_rows=skip_bad_rows,
        max_bad_samples=max_bad_samples,
        write_workers=write_workers,
        logit_check_samples=logit_check_samples,
        progress=not no_progress,
        deep_verify=deep_verify,
    )
    from speculators_v016.run.console import Console, run_log_path
    from speculators_v016.run.run_report import run_and_report

    suffix = f"-{shard_name(index, shards)}" if shards > 1 else ""
    with Console(run_log_path(output_dir, "run", suffix), ctx.obj["mode"], log_level) as console:
        code = run_and_report(opts, console)
    ctx.exit(code)


@cli.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--partial", is_flag=True, help="Check what is there, not that the run is complete.")
@click.pass_obj
def verify(obj, directory, partial):
    """Check DIRECTORY (and its shard-* folders): every sample present once, intact, as configured."""
    from speculators_v016.run.console import Console, scratch_log_path
    from speculators_v016.store.verify import verify as run_verify

    with Console(scratch_log_path("verify"), obj["mode"], obj["log_level"]) as console:
        try:
            report = run_verify(directory, partial=partial)
        except Exception as exc:  # noqa: BLE001 - verify reports findings; anything else is a bug of ours, said so
            console.failure(f"FAIL {directory}: verify could not run ({type(exc).__name__}: {exc})")
            console.log_exception(exc)
            sys.exit(ExitCode.PROBLEMS_FOUND)
        for problem in report.problems:
            console.echo(f"FAIL {problem}", summary=True)
        for note in report.notes:
            console.echo(f"note {note}")
        status = "ok" if report.ok else "FAILED"
        console.echo(
            f"{status}: {report.samples} samples, {report.tokens} tokens in {len(report.folders)} "
            f"folder(s), {len(report.problems)} problem(s)",
            summary=True,
        )
    sys.exit(ExitCode.OK if report.ok else ExitCode.PROBLEMS_FOUND)


@cli.command()
@click.option("--target-model-path", required=True)
@click.option("--train-data-path", multiple=True, required=True)
@click.option("--samples", type=click.IntRange(min=1), default=4, help="How many samples to compare.")
@click.option("--seq-length", type=click.IntRange(min=1), default=512)
@click.option("--layer-ids", default=None)
@click.option("--dtype", default="auto", help="The engine's dtype (transformers runs in fp32).")
@click.option("--enforce-eager", is_flag=True)
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1)
@click.option("--trust-remote-code", is_flag=True)
@click.option(
    "--no-transformers",
    is_flag=True,
    help="Skip the whole-model comparison with transformers (targets that do not fit in memory "
    "here); the logit check (final norm + lm_head vs vLLM's logits) and the layer replay (one "
    "layer's weights at a time) still run.",
)
@click.pass_obj
def check(
    obj,
    target_model_path,
    train_data_path,
    samples,
    seq_length,
    layer_ids,
    dtype,
    enforce_eager,
    tensor_parallel_size,
    trust_remote_code,
    no_transformers,
):
    """Check captured states: vLLM's logits, each layer replayed in transformers, the whole model if it fits."""
    from speculators_v016.run.console import Console, scratch_log_path
    from speculators_v016.run.run_report import exit_code
    from speculators_v016.settings import EngineSettings

    layers = _layer_ids(layer_ids)
    with Console(scratch_log_path("check"), obj["mode"], obj["log_level"]) as console:
        try:
            from speculators_v016.run.check import check as run_check

            settings = EngineSettings(
                model=target_model_path,
                max_model_len=seq_length + 1,
                dtype=dtype,
                enforce_eager=enforce_eager,
                tensor_parallel_size=tensor_parallel_size,
                trust_remote_code=trust_remote_code,
            )
            report = run_check(
                settings, list(train_data_path), samples, seq_length, layers, with_transformers=not no_transformers
            )
        except Exception as exc:  # noqa: BLE001 - explained, logged, exit code by kind
            console.failure(f"error: {type(exc).__name__}: {exc}")
            sys.exit(exit_code(exc))
        for line in report.lines():
            console.echo(line, summary=True)
        console.where()
    sys.exit(ExitCode.OK if report.ok else ExitCode.PROBLEMS_FOUND)


@cli.command()
@click.option(
    "--dir",
    "where",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("speculators-demo"),
    help="Where the tiny model and the data go.",
)
@click.option("--format", "fmt", type=click.Choice(["safetensors", "pt"]), default="safetensors")
@click.pass_obj
def demo(obj, where, fmt):
    """Run the whole pipeline on a tiny random model and bundled sample conversations."""
    from speculators_v016.run.console import Console, log_path
    from speculators_v016.run.demo import run_demo

    with Console(log_path(where, "demo"), obj["mode"], obj["log_level"]) as console:
        code = run_demo(where, fmt, console)
    sys.exit(code)


@cli.command("clean-shm")
@click.option("--yes", is_flag=True, help="Delete what is listed (without it: only list).")
@click.option("--shm-dir", default="/dev/shm", show_default=True, hidden=True)
def clean_shm(yes, shm_dir):
    """List (and with --yes delete) the shared memory that dead runs of ours recorded in /dev/shm.

    Every run records the segments its processes create (our capture ring,
    vLLM's psm_* queues, multiprocessing's sem.mp-* semaphores) under a lock it
    holds while it lives; a run finds and deletes dead runs' segments at start.
    This command does the same on demand: only recorded names of runs whose lock
    is free, and only while each is still the recorded file. A run killed before
    it recorded a segment (within a second of its creation, during engine start)
    leaves a name no record holds: it is not touched here; remove it by hand.
    """
    from speculators_v016.shared.shm_records import reclaim, report_lines

    result = reclaim(shm_dir, delete=yes)
    for line in report_lines(result, shm_dir, deleted=yes):
        click.echo(line)
    sys.exit(ExitCode.OK)


_INT = re.compile(r"[+-]?\d+(,[+-]?\d+)*,?")


def _join_multi_value(argv: list[str], option: str) -> list[str]:
    """Upstream took ``--layer-ids 2 16 29 31`` (argparse nargs='+'); click takes one value. The values are the
    arguments that follow and do not start with ``-``, or are integers (``-1``: refused with its own message)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        if arg == option or arg.startswith(option + "="):
            values = [arg.partition("=")[2]] if "=" in arg else []
            while i + 1 < len(argv) and (not argv[i + 1].startswith("-") or _INT.fullmatch(argv[i + 1])):
                values.append(argv[i + 1])
                i += 1
            out += [option, " ".join(v for v in values if v)]
        else:
            out.append(arg)
        i += 1
    return out


def main() -> None:
    cli.main(args=_join_multi_value(sys.argv[1:], "--layer-ids"), prog_name="speculators-data-gen")


if __name__ == "__main__":
    main()
