"""The configuration of a run: one tree of frozen dataclasses, every default once.

The tree::

    RunConfig                one run of ``speculators-data-gen`` (the pipeline's input)
      engine: EngineConfig   what the capture engine needs to start vLLM (the generator's keywords)
    CheckConfig              one ``check`` (speculators_v016.run.check)
      engine: EngineConfig
    ConsoleConfig            what the terminal shows (the command group's options, for every subcommand)
    ServeConfig              ``serve``: the capture engine as a service (speculators_v016.serve)
      engine: EngineConfig
    VerifyConfig, DemoConfig, CleanShmConfig   the ``verify``, ``demo`` and ``clean-shm`` subcommands

Each field is declared with :func:`setting`: its default, its help text (the
field's documentation), its bounds, and, for the fields that are options of
the command, the option's spelling and help section. Choices are ``Literal``
types. :mod:`speculators_v016.run.cli` generates the click options of the
main command and of every subcommand from these fields (:data:`MAIN_OPTIONS`,
:data:`CHECK_OPTIONS`, ...), so a new option is one field here, and the
environment variable of option ``--some-option`` is always
``SPECULATORS_DATA_GEN_SOME_OPTION``. Values that depend on others
(``max_model_len`` from ``seq_length``, the engine's seed) are computed once,
in :meth:`RunConfig.build`; the run's config is built whole from the command
line and passed whole: CLI -> pipeline -> engine -> workers
(:class:`~speculators_v016.protocol.WorkerSetup`).

Adding an option: one field in the class it configures, as ``--checksum`` is in :class:`RunConfig`::

    checksum: Checksum | None = setting(None, "Digest of each sample file in the manifest ...", section=OUTPUT)

with ``Checksum = Literal["blake3", "sha256"]`` beside the other choices. That
is ``--checksum [blake3|sha256]`` with its help, default and check at parse
time, ``SPECULATORS_DATA_GEN_CHECKSUM``, and ``RunConfig.checksum`` where the
pipeline needs it (``opts.checksum``); a flag is a ``bool`` field, a bound is
``min=``/``max=``, an engine setting a field of :class:`EngineConfig`.

This module imports nothing of the package or of click (torch only where the GPUs are counted): every
side may import it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal

from speculators_v016.redact import redact

ENV_PREFIX = "SPECULATORS_DATA_GEN"

# -- choices --------------------------------------------------------------
Executor = Literal["uni", "mp", "ray"]
#: "auto": vLLM's built-in aux hidden state outputs where the model has them; "taps": ours on every model.
CaptureMode = Literal["auto", "taps"]
#: Where each step's rows are copied out of the capture ring (speculators_v016.engine.row_copies).
RowCopyPlace = Literal["auto", "thread", "inline"]
#: Who writes the sample files (speculators_v016.store.write_helper): "off" (the default) the writer threads
#: themselves, "on" a helper process for each writer thread (states in the pool's shared blocks).
WriteHelpers = Literal["on", "off"]
#: How hidden states are stored: "auto" in the engine's dtype; "fp8_e4m3": e4m3 codes + a float32 scale
#: per token per layer, quantized in the worker's capture (:mod:`speculators_v016.fp8`).
HiddenStatesDtype = Literal["auto", "fp8_e4m3"]
#: vLLM 0.16's model dtypes (``vllm.config.model.ModelDType``).
ModelDtype = Literal["auto", "bfloat16", "float16", "float32", "half", "float"]
ServeBackend = Literal["folder", "mooncake"]
SampleFormat = Literal["safetensors", "pt"]
#: The digest of each sample file that the manifest records (speculators_v016.store.checksum).
Checksum = Literal["blake3", "sha256"]
#: --regenerate's samples: whole conversations where the chat template allows it exactly, or one per turn
RegenerateSamples = Literal["auto", "turn"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]

EXECUTORS: tuple[str, ...] = typing.get_args(Executor)
CAPTURE_MODES: tuple[str, ...] = typing.get_args(CaptureMode)
HIDDEN_STATES_DTYPES: tuple[str, ...] = typing.get_args(HiddenStatesDtype)
MODEL_DTYPES: tuple[str, ...] = typing.get_args(ModelDtype)

# -- defaults that are not options ------------------------------------------
#: ``max_num_batched_tokens`` when not given: at least this, and at least ``max_model_len``.
MIN_DEFAULT_BATCHED_TOKENS = 8192
#: Nice levels the writer threads run below the process: where cores are contended the engine's
#: thread (and a CPU engine's forward) gets them first, the writers what is left behind their bounded queue.
WRITER_NICE_INCREMENT = 10
#: Torch threads for the engine's copy of each step out of its ring slot (GPU engines; a CPU engine's
#: threads are vLLM's, bound to its cores). On an H200 host (16 cores) a 448 MiB step took 11 ms with
#: torch's 16 threads on an idle host but 128 ms while 4 writers hashed (one busy core stalls the whole
#: parallel copy), 25 ms with 4 threads either way, 80 ms with the 1 thread vLLM's mp executor leaves.
DEFAULT_COPY_THREADS = 4
#: Host memory made and touched ahead for the prompts next in line (GPU engines; speculators_v016.engine.prefault):
#: about two 8192-token steps at hidden 7168 with 4 layers captured (448 MiB each).
PREFAULT_BYTES = 1 << 30
#: Threads touching it, at most (a quarter of the cores): one touches 1.6-1.7 GB/s in 4 KiB pages, 8-9 GB/s in huge
#: pages (AVX2 EPYC host), and a Kimi-shaped GPU step wants about 9 GB/s.
PREFAULT_THREADS = 4


def default_write_workers(cores: int) -> int:
    """Threads publishing ``serve``'s sample files: 4 (tools/benchmarks/host_path.py: 2 leave part of a disk idle,
    4 reach it), up to 8 with half the cores."""
    return max(4, min(8, cores // 2))


DEFAULT_WRITE_WORKERS = default_write_workers(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4)
#: A run's writer threads, when --write-workers is not given: one per this many bytes a token weighs on disk.
WRITER_TOKEN_BYTES = 4096
#: ... and at most this many where the threads write every file themselves (the default). It was 8: on an H200
#: host (16 cores, files in RAM) 8 writers alone wrote 8.24 GiB/s on 8.4 cores, 12 and 16 wrote 7.65 and 7.69 GiB/s
#: (tools/benchmarks/host_path.py, 2026-12-04, the writers testing for NaN/Inf). In the CLI itself, at hidden 7168 in
#: bf16 on an H100 host (16 cores, files in RAM, 2026-12-06, no run the job's first), 12 writers made 148,276-150,579
#: tokens/s against 141,448-148,339 for 8, whose engine thread waited 1.1-1.3 s for them (12: 0.0 s)
#: (docs/benchmarks/README.md), so a 16-core host now takes 12 at that width (three quarters of its cores). With
#: write helpers (store/write_helper.py) each thread's file is written by a process of its own: no cap but the cores'.
MAX_WRITE_WORKERS = 16


def write_helpers_used(setting: str) -> bool:
    """Whether a run's writers hand their files to helper processes: ``--write-helpers on`` only. On the H100 host
    (2026-12-05, hidden 7168, bf16, files in RAM) 12 writers with helpers made 90,763 tokens/s against 120,548 for 8
    threads (1.77 against 1.04 CPU-s per GiB), and in FP8 151,835 against 154,267 with 7: no default takes them."""
    return setting == "on"


def write_workers_for(cores: int, token_bytes: int, helpers: bool = False) -> int:
    """A run's writer threads from the bytes a token weighs on disk and the cores: one per 4 KiB (a writer checks,
    hashes and writes about 1 GiB per CPU-second, tools/benchmarks/host_path.py; an H200 computes ~120-160k
    tokens/s at hidden 4096-7168, 32-56 KiB a token with 4 layers in bf16: 3.7-8.7 GiB/s), at least 4 (a disk's
    worth of concurrent writes), at most three quarters of the cores (the rest: vLLM's engine thread, the copy
    threads) and, without ``helpers``, :data:`MAX_WRITE_WORKERS`. A 16-core host: 8 at hidden 4096 and 12 at 7168 in
    bf16, 7 at 7168 and 4 at 4096 in FP8 (4 layers); 2 cores: 4."""
    cap = cores * 3 // 4 if helpers else min(cores * 3 // 4, MAX_WRITE_WORKERS)
    return max(4, min(round(token_bytes / WRITER_TOKEN_BYTES), cap))


def last_samples_threads(cores: int, workers: int, given: bool) -> int:
    """Threads a run adds for the samples still queued once its engine is done (its cores are free then): up to
    three quarters of the cores with the ``workers``, none where the user gave ``--write-workers`` (``given``):
    that many threads, no more (on a 16-core host ``--write-workers 1`` got 11 more until 2026-12-06)."""
    return 0 if given else max(0, cores * 3 // 4 - workers)


# -- help sections, in --help's order -----------------------------------------
INPUT, OUTPUT, ENGINE, CHECKS, TERMINAL = "Input", "Output", "Engine (vLLM)", "Self-check", "Terminal"
REGENERATION = "Regeneration (on-policy data)"
SERVICE = "Service"
SECTIONS = (INPUT, REGENERATION, SERVICE, OUTPUT, ENGINE, CHECKS, TERMINAL)


class ConfigError(ValueError):
    """A value (or a combination of values) that cannot run; ``option`` names the option to blame, if one."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    option: str | None = None,
    section: str | None = None,
    short: str | None = None,
    negate: bool = False,
    cli_default: Any = MISSING,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    case_sensitive: bool = True,
    required: bool = False,
    kind: str | None = None,
    hidden: bool = False,
    default_factory: Any = MISSING,
) -> Any:
    """A field of the tree and, with ``section``, an option of the command.

    ``help``: the field's documentation and the option's help. ``option``: the
    option's spelling (default ``--field-name``); ``negate``: a flag that sets
    the field to False (``--sync-scheduling`` for ``async_scheduling``).
    ``required``: the option must be given (where the command has nothing to do without it).
    ``cli_default``: the option's default where it differs from the field's
    (resolved by :meth:`RunConfig.build`, e.g. ``--tensor-parallel-size``:
    all visible GPUs). ``min``/``max``/``min_open``: bounds, checked here and
    by the option. ``kind``: a value with its own parser on the command line
    (``"layer_ids"``, ``"dir"``). ``hidden``: an option left out of ``--help`` (for tests).
    """
    meta = {
        "help": help,
        "option": option,
        "section": section,
        "short": short,
        "negate": negate,
        "cli_default": cli_default,
        "min": min,
        "max": max,
        "min_open": min_open,
        "case_sensitive": case_sensitive,
        "required": required,
        "kind": kind,
        "hidden": hidden,
    }
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Field:
    """One field of the tree as the command line sees it (see :func:`fields_of`)."""

    owner: type
    name: str
    type: Any  # the resolved annotation
    default: Any
    meta: Mapping[str, Any]

    @property
    def is_option(self) -> bool:
        return self.meta.get("section") is not None

    @property
    def flag(self) -> str:
        return self.meta.get("option") or "--" + self.name.replace("_", "-")

    @property
    def param(self) -> str:
        """The click parameter's name: the flag's, so ``--format`` is ``format`` and ``--sync-scheduling``
        ``sync_scheduling``."""
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def cli_default(self) -> Any:
        value = self.meta.get("cli_default", MISSING)
        if value is not MISSING:
            return value
        if self.meta.get("negate"):
            return False
        return None if self.default is MISSING else self.default

    @property
    def choices(self) -> tuple | None:
        """The ``Literal`` values of the field's type (``X | None`` included), or None."""
        for t in (self.type, *typing.get_args(self.type)):
            if typing.get_origin(t) is Literal:
                return typing.get_args(t)
        return None

    @property
    def base(self) -> type:
        """The field's type without ``None``: ``int`` for ``int | None``, ``tuple`` for ``tuple[str, ...]``."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        t = args[0] if typing.get_origin(self.type) in (typing.Union, _UnionType) and len(args) == 1 else self.type
        return typing.get_origin(t) or t


_UnionType = type(int | None)


@functools.cache
def fields_of(cls: type) -> tuple[Field, ...]:
    """``cls``'s fields with their resolved types and metadata."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        out.append(Field(cls, f.name, hints[f.name], f.default, f.metadata))
    return tuple(out)


def _check(obj) -> None:
    """Choices and bounds of every field of ``obj`` (a dataclass of this tree)."""
    for f in fields_of(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            continue
        choices = f.choices
        if choices is not None and value not in choices:
            raise ConfigError(f"{f.name} {value!r}: choose from {choices}", f.flag if f.is_option else None)
        low, high, low_open = f.meta.get("min"), f.meta.get("max"), f.meta.get("min_open")
        if low is not None and (value < low or (low_open and value == low)):
            raise ConfigError(f"{f.name} {value!r}: must be {'>' if low_open else '>='} {low}", f.flag)
        if high is not None and value > high:
            raise ConfigError(f"{f.name} {value!r}: must be <= {high}", f.flag)


def parse_layer_ids(value: str) -> tuple[int, ...]:
    """``--layer-ids``'s value (space- or comma-separated); ConfigError if empty, not integers, or negative."""
    try:
        ids = tuple(int(v) for v in value.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"{value!r}: give integers, e.g. --layer-ids 2 16 29 31", "--layer-ids") from None
    if not ids:
        raise ConfigError(
            "no layer id given (an empty value, e.g. an unset variable?); give ids such as "
            "--layer-ids 2 16 29 31, or leave the option out for the default layers",
            "--layer-ids",
        )
    negative = [i for i in ids if i < 0]
    if negative:
        raise ConfigError(
            f"{negative} negative: id L is the output of decoder layer L, from 0 to n-1 "
            "(the last layer); ids counted from the end are not accepted, give n-1 itself",
            "--layer-ids",
        )
    return ids


#: vLLM ``EngineArgs`` our own settings give, with the option that sets each (None: the capture's own).
ENGINE_ARGS_OWNED = {
    "model": "--target-model-path",
    "trust_remote_code": "--trust-remote-code",
    "dtype": "--dtype",
    "seed": "--seed",
    "max_model_len": "--seq-length",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_num_seqs": "--max-num-seqs",
    "tensor_parallel_size": "--tensor-parallel-size",
    "pipeline_parallel_size": "--pipeline-parallel-size",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enforce_eager": "--enforce-eager",
    "distributed_executor_backend": "--executor",
    "async_scheduling": "--sync-scheduling",
    "worker_extension_cls": None,
    "additional_config": None,
}

#: ``EngineArgs`` that would break the capture, each with the value it may keep and why any other is refused.
ENGINE_ARGS_REFUSED = {
    "enable_prefix_caching": (
        (False, None),
        "a cached prefix is not computed again, so its positions would have no hidden states",
    ),
    "speculative_config": (
        (None, {}),
        "speculative decoding adds draft steps to the target's; the capture reads the target's prompt passes",
    ),
    "data_parallel_size": (
        (1,),
        "a run drives one engine core; split the data over runs with --num-shards and --shard-index instead",
    ),
    "kv_transfer_config": (
        (None,),
        "a KV connector loads keys and values computed elsewhere into the prompts, whose positions are then not "
        "computed here: their states would be missing, or those of whatever filled the cache",
    ),
    "model_weights": (
        ("",),
        "it points vLLM's sharded_state and runai_streamer loaders at other weights than --target-model-path "
        "(every other loader ignores it), while the fingerprint, the checks and data_config.json describe "
        "--target-model-path; give the weights' folder as --target-model-path",
    ),
}


def refuse_engine_args(args: Mapping[str, Any]) -> None:
    """ConfigError naming the first of ``args`` (vLLM engine arguments passed through) that cannot be given:
    one an option of ours sets, or one that would break the capture. Whether vLLM knows the rest, and
    takes their values, is vLLM's to say (:func:`speculators_v016.engine.engine_args.check_engine_args`)."""
    option = "--engine-args"
    if not isinstance(args, Mapping):
        raise ConfigError(f"{type(args).__name__} given: a JSON object of vLLM EngineArgs fields is needed", option)
    for key, value in args.items():
        if not isinstance(key, str):
            raise ConfigError(f"{key!r}: the keys are names of vLLM EngineArgs fields", option)
        if key in ENGINE_ARGS_OWNED:
            ours = ENGINE_ARGS_OWNED[key]
            raise ConfigError(
                f"{key!r} is set by " + (f"{ours}: give that option instead" if ours else "the capture itself"),
                option,
            )
        if key in ENGINE_ARGS_REFUSED:
            allowed, why = ENGINE_ARGS_REFUSED[key]
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise ConfigError(f"{key}={redact(value)!r} is refused: {why}", option)


def visible_gpus() -> int:
    """GPUs this process sees, at least 1."""
    import torch  # noqa: PLC0415 - torch only to count GPUs; the CLI's --help path imports this

    return max(1, torch.cuda.device_count())


def _env_int(environ: Mapping[str, str], names: tuple[str, ...], minimum: int) -> int | None:
    """The first of the launcher variables ``names`` that is set, as an integer >= ``minimum``; ConfigError if not."""
    for name in names:
        value = environ.get(name)
        if value:
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is None or number < minimum:
                raise ConfigError(
                    f"environment variable {name}={value!r} is not a whole number >= {minimum} "
                    "(launchers such as torchrun and SLURM set it; or give --num-shards and "
                    "--shard-index)"
                )
            return number
    return None


def launcher_shards(
    num_shards: int | None, shard_index: int | None, environ: Mapping[str, str] = os.environ
) -> tuple[int, int]:
    """--num-shards/--shard-index, else a launcher's RANK/WORLD_SIZE (torchrun) or SLURM's, else (1, 0)."""
    if num_shards is None:
        num_shards = _env_int(environ, ("WORLD_SIZE", "SLURM_NTASKS"), 1) or 1
    if shard_index is None:
        shard_index = (_env_int(environ, ("RANK", "SLURM_PROCID"), 0) or 0) if num_shards > 1 else 0
    return num_shards, shard_index


def max_model_len_for(seq_length: int) -> int:
    """vLLM's ``max_model_len`` for samples of ``seq_length`` tokens: room for the one sampled token."""
    return seq_length + 1


@dataclass(frozen=True)
class EngineConfig:
    """What the capture engine needs to start vLLM 0.16 (the layer plan travels beside it).

    The keywords of :class:`~speculators_v016.generator.VllmHiddenStatesGenerator`
    beyond upstream's; :class:`~speculators_v016.engine.core.CaptureEngine`
    turns it into vLLM's ``EngineArgs``.
    """

    model: str = setting(
        MISSING,
        "Target model: local folder or hub id (what vLLM loads).",
        option="--target-model-path",
        section=INPUT,
        cli_default=None,
    )
    trust_remote_code: bool = setting(False, "Allow the model folder's own Python code to run.", section=INPUT)
    hidden_states_dtype: HiddenStatesDtype = setting(
        "auto",
        "How states are stored: auto = the engine's dtype; fp8_e4m3 = e4m3 codes + one float32 scale "
        "per token per layer, quantized in the capture (half the bytes; safetensors only).",
        section=OUTPUT,
    )
    tensor_parallel_size: int = setting(
        1, "GPUs per model. Default: all visible GPUs, or 1.", section=ENGINE, min=1, cli_default=None
    )
    pipeline_parallel_size: int = setting(
        1,
        "Pipeline stages (across nodes: TP 8 x PP 2 with Ray); each stage captures its own layers "
        "(docs/pipeline-parallel.md).",
        section=ENGINE,
        min=1,
    )
    gpu_memory_utilization: float = setting(
        0.8, "vLLM's GPU memory fraction.", section=ENGINE, min=0, max=1, min_open=True
    )
    dtype: ModelDtype = setting(
        "auto", "vLLM dtype (auto = the checkpoint's; on CPU auto means bfloat16).", section=ENGINE
    )
    enforce_eager: bool = setting(False, "Skip torch.compile / CUDA graphs (faster start, slower run).", section=ENGINE)
    async_scheduling: bool = setting(
        True,
        "Turn vLLM's async scheduling off (one step in flight).",
        option="--sync-scheduling",
        negate=True,
        section=ENGINE,
    )
    pipeline_async_scheduling: bool = setting(
        False,
        "Keep async scheduling under pipeline parallelism. Off by default: vLLM 0.16's async PP makes the first "
        "stage wait for each step's sampled tokens, so stages do not overlap (0.69x on CPU, "
        "docs/pipeline-parallel.md); one batch per stage stays in flight either way.",
        section=ENGINE,
    )
    max_num_seqs: int = setting(32, "Prompts per engine step at most.", section=ENGINE, min=1)
    max_num_batched_tokens: int | None = setting(
        None,
        f"Tokens per engine step (default: max({MIN_DEFAULT_BATCHED_TOKENS}, seq-length+1)).",
        section=ENGINE,
        min=1,
    )
    executor: Executor | None = setting(
        None,
        "vLLM executor (default: vLLM's choice: uni for one device, mp for tensor parallelism).",
        section=ENGINE,
    )
    row_copies: RowCopyPlace = setting(
        "auto",
        "Where each step's rows are copied out of the capture ring into the samples: thread (one of their own, "
        "while the engine's thread schedules the next steps), inline (on the engine's thread), auto (thread on "
        "GPU engines, inline on CPU ones, whose forward takes every core). The files are the same either way.",
        section=ENGINE,
    )
    # not options: set by the library's callers, or derived by RunConfig.build
    max_model_len: int = setting(2048, "vLLM's longest prompt + output (a run: --seq-length + 1).", min=1)
    seed: int = setting(0, "vLLM's seed (a run: --seed).")
    capture_mode: CaptureMode = setting("auto", "auto: vLLM's built-in aux outputs where it has them; taps: ours.")
    extra_engine_args: dict = setting(
        help="More of vLLM's engine arguments, as a JSON object of EngineArgs fields, passed through and checked "
        'by vLLM before the model loads, e.g. \'{"kv_cache_dtype": "fp8", "enable_expert_parallel": true}\' '
        "(docs/commands/run.md#vllms-engine-arguments).",
        option="--engine-args",
        section=ENGINE,
        kind="json_object",
        cli_default={},
        default_factory=dict,
    )

    def __post_init__(self) -> None:
        _check(self)
        if self.extra_engine_args is None:
            object.__setattr__(self, "extra_engine_args", {})
        refuse_engine_args(self.extra_engine_args)

    @property
    def fp8(self) -> bool:
        """Hidden states stored as FP8 codes and scales."""
        return self.hidden_states_dtype == "fp8_e4m3"

    @property
    def tokenizer(self) -> str:
        """The tokenizer's folder or hub id: ``--engine-args``' ``tokenizer`` where given (vLLM's too), else the model's."""
        return self.extra_engine_args.get("tokenizer") or self.model

    @property
    def batched_tokens(self) -> int:
        """``max_num_batched_tokens``, with its default resolved."""
        return self.max_num_batched_tokens or max(MIN_DEFAULT_BATCHED_TOKENS, self.max_model_len)

    @classmethod
    def for_seq_length(cls, seq_length: int, **fields) -> EngineConfig:
        """An engine for samples of at most ``seq_length`` tokens (``max_model_len`` derived here, once)."""
        return cls(max_model_len=max_model_len_for(seq_length), **fields)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run: the engine's config (passed whole to the generator), and what the run does around it."""

    engine: EngineConfig
    train_data_path: tuple[str, ...] = setting(
        MISSING,
        "Dataset (ShareGPT 'conversations', 'messages', or pre-tokenized 'input_ids'+'loss_mask' rows): a "
        ".json/.jsonl/.jsonl.gz/.jsonl.zst/.parquet file, a folder of .parquet files or of datasets' save_to_disk "
        "(FOLDER@SPLIT for one split), a dataset name upstream knows (sharegpt, ultrachat), or a hub dataset "
        "ORG/NAME@SPLIT or ORG/NAME:CONFIG@SPLIT (from --hf-cache-dir where no hub is reachable). Repeat to "
        "combine; VALUE#max=N keeps a source's first N rows, in its order, before the shuffle.",
        section=INPUT,
        cli_default=(),
    )
    seq_length: int = setting(2048, "Longest sample in tokens; longer ones are truncated.", section=INPUT, min=1)
    max_samples: int | None = setting(None, "Use at most this many rows (after shuffling).", section=INPUT, min=1)
    layer_ids: tuple[int, ...] | None = setting(
        None,
        "Layers to capture: id L = output of decoder layer L, before the final norm "
        "(upstream's meaning), 0 to n-1. Space- or comma-separated. Default: 2, n//2, n-3, n-1.",
        section=INPUT,
        kind="layer_ids",
    )
    assistant_pattern: str | None = setting(
        None, "Regex of assistant spans (default: from the chat template).", section=INPUT
    )
    turn_dropout: bool = setting(False, "Keep a random number of leading turns per conversation.", section=INPUT)
    seed: int = setting(
        0,
        "Shuffle (and turn dropout) seed; with --regenerate also each sample's sampling seed (with its index).",
        section=INPUT,
    )
    hf_cache_dir: str | None = setting(None, "Cache folder for hub datasets.", section=INPUT)
    num_preprocessing_workers: int = setting(8, "Processes for tokenization.", section=INPUT, min=1)
    skip_bad_rows: bool = setting(False, "Skip (and count) malformed dataset rows instead of failing.", section=INPUT)
    keep_duplicate_rows: bool = setting(
        False,
        "Keep rows whose content is exactly an earlier row's (default: the first is kept, the others dropped and "
        "counted as 'duplicate row'); e.g. a source given twice to weigh it twice.",
        section=INPUT,
    )
    prepared_cache: str | None = setting(
        None,
        "Folder keeping tokenized rows (and the row index, and the input files' sha256 by their stat) for later "
        "runs, resumes and other shards, keyed by the inputs' sha256 (with each source's split, config and cap), "
        "the tokenizer, the chat template, --seq-length and every preprocessing option; about 5 bytes a token. "
        "Default: $XDG_CACHE_HOME/speculators_v016/prepared, else ~/.cache/speculators_v016/prepared. The summary "
        "says its size.",
        section=INPUT,
    )
    use_prepared_cache: bool = setting(
        True,
        "Keep no tokenized rows: every run tokenizes its rows (and hashes every input).",
        option="--no-prepared-cache",
        negate=True,
        section=INPUT,
    )
    regenerate: bool = setting(
        False,
        "The target writes every assistant turn (conditioned on the history regenerated so far) and the same "
        "pass captures it: on-policy data (docs/regenerate.md).",
        section=REGENERATION,
    )
    regenerate_samples: RegenerateSamples = setting(
        "auto",
        "auto: a conversation's generated turns share one sample where the chat template renders each turn's "
        "prompt + sampled ids as the start of the next prompt, token for token (else one sample per turn); "
        "turn: one sample per generated turn.",
        section=REGENERATION,
    )
    temperature: float | None = setting(
        None,
        "Sampling temperature of --regenerate (default: the target's generation_config.json; 0: greedy).",
        section=REGENERATION,
        min=0,
    )
    top_p: float | None = setting(
        None,
        "Top-p of --regenerate (default: generation_config.json's, else 1).",
        section=REGENERATION,
        min=0,
        min_open=True,
        max=1,
    )
    top_k: int | None = setting(
        None,
        "Top-k of --regenerate (default: generation_config.json's, else off; 0: off).",
        section=REGENERATION,
        min=0,
    )
    max_new_tokens: int | None = setting(
        None,
        "Longest generated turn in tokens (default: generation_config.json's max_new_tokens, else up to "
        "--seq-length); a turn cut there is kept and marked.",
        section=REGENERATION,
        min=1,
    )
    output_dir: Path = setting(
        MISSING,
        "Folder for the samples; an interrupted run resumes in it.",
        section=OUTPUT,
        kind="dir",
        cli_default=None,
    )
    format: SampleFormat = setting(
        "safetensors",
        "safetensors (no pickle), or pt: upstream's data_{i}.pt layout for stock trainers.",
        section=OUTPUT,
    )
    start_idx: int = setting(0, "Offset added to every sample index in file names.", section=OUTPUT, min=0)
    num_shards: int = setting(
        1, "Split samples over this many runs (default: WORLD_SIZE).", section=OUTPUT, min=1, cli_default=None
    )
    shard_index: int = setting(
        0, "Which shard this run writes (default: RANK).", section=OUTPUT, min=0, cli_default=None
    )
    token_freq_path: str = setting("./token_freq.pt", "Where upstream's token frequency file goes.", section=OUTPUT)
    ignore_disk_forecast: bool = setting(
        False,
        "Start even where the bytes the run will write (tokens x layers x hidden x storage bytes, said on the "
        "terminal) exceed the folder's free space.",
        section=OUTPUT,
    )
    write_workers: int | None = setting(
        None,
        "Threads writing sample files (default: one per 4 KiB a token weighs on disk, at least 4 and at most "
        "three quarters of the cores, 16 at most unless --write-helpers on, and more for the samples still queued "
        "once the engine is done; given, that many and no more; the summary's host path line says how many).",
        section=OUTPUT,
        min=1,
    )
    direct_io: bool = setting(
        True,
        "Write sample files through the page cache (default: O_DIRECT, from the states' memory to the disk, "
        "where the file system takes it, and through the page cache on tmpfs and ramfs, whose files are memory "
        "pages; the summary's host path line says how the bytes went).",
        option="--no-direct-io",
        negate=True,
        section=OUTPUT,
    )
    write_helpers: WriteHelpers = setting(
        "off",
        "Who hashes, tests and writes the sample files whose states lie in the buffer pool's shared memory: off (the "
        "writer threads) or on (a helper process for each writer thread, beside its own GIL; slower on the GPU host "
        "measured so far: docs/commands/run.md; the summary's host path line says which).",
        section=OUTPUT,
    )
    checksum: Checksum | None = setting(
        None,
        "Digest of each sample file in the manifest (default: blake3 for a new folder, a resumed folder's own; "
        "sha256 for tooling that wants it).",
        section=OUTPUT,
    )
    batch_size: int = setting(
        8, "Prompts admitted ahead of the engine (at least 2 x max-num-seqs).", section=ENGINE, min=1
    )
    max_bad_samples: int = setting(10, "Abort after more samples than this with NaN/Inf states.", section=CHECKS, min=0)
    logit_check_samples: int = setting(
        4,
        "Samples whose captured last layer, normed and projected, must reproduce vLLM's own prompt "
        "logprobs (needs only the final norm and lm_head; 0: off).",
        section=CHECKS,
        min=0,
    )
    deep_verify: bool = setting(
        False,
        "After the run, re-read every file of the folder (sha256, shapes, NaN), not just the manifest.",
        section=CHECKS,
    )
    progress: bool = setting(True, "No progress bar.", option="--no-progress", negate=True, section=TERMINAL)

    def __post_init__(self) -> None:
        _check(self)
        if self.engine.fp8 and self.format != "safetensors":
            raise ConfigError(
                f"--hidden-states-dtype {self.engine.hidden_states_dtype} is stored as safetensors only: "
                f"upstream's .pt readers would take the FP8 codes for values (--format {self.format})",
                "--format",
            )
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(f"shard index {self.shard_index} is not in [0, {self.num_shards})", "--shard-index")
        if not self.regenerate:
            for name in ("temperature", "top_p", "top_k", "max_new_tokens"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise ConfigError(f"{flag} samples the target's responses: it needs --regenerate", flag)
            if self.regenerate_samples != "auto":
                raise ConfigError(
                    "--regenerate-samples shapes the samples of generated turns: it needs --regenerate",
                    "--regenerate-samples",
                )
        else:
            for name, value in (("--turn-dropout", self.turn_dropout), ("--assistant-pattern", self.assistant_pattern)):
                if value:
                    raise ConfigError(f"{name} shapes the dataset's own responses: --regenerate writes new ones", name)

    @classmethod
    def build(cls, engine: Mapping[str, Any], environ: Mapping[str, str] = os.environ, **run: Any) -> RunConfig:
        """The run's config from its settings as given (the command line's, or a caller's), with what they
        leave open resolved, once: the engine's ``max_model_len`` and seed from the run's ``seq_length`` and
        ``seed``; ``tensor_parallel_size`` None: the visible GPUs (or 1); ``num_shards``/``shard_index``
        None: a launcher's (torchrun's WORLD_SIZE/RANK, SLURM's), else one shard."""
        engine = dict(engine)
        if engine.get("tensor_parallel_size") is None:
            engine["tensor_parallel_size"] = visible_gpus()
        run["num_shards"], run["shard_index"] = launcher_shards(run.get("num_shards"), run.get("shard_index"), environ)
        seq_length, seed = (
            run.get("seq_length", default_of(cls, "seq_length")),
            run.get("seed", default_of(cls, "seed")),
        )
        return cls(engine=EngineConfig.for_seq_length(seq_length, seed=seed, **engine), **run)


@dataclass(frozen=True)
class ConsoleConfig:
    """What the terminal shows and the log keeps (options of the command group: every subcommand's too)."""

    log_level: LogLevel = setting("INFO", "Our messages kept in the log file.", section=TERMINAL, case_sensitive=False)
    verbose: bool = setting(
        False, "Everything on the terminal (vLLM, torch, workers), no log file.", section=TERMINAL, short="-v"
    )
    quiet: bool = setting(False, "Only the summary and errors on the terminal.", section=TERMINAL, short="-q")

    def __post_init__(self) -> None:
        _check(self)
        if self.verbose and self.quiet:
            raise ConfigError("--verbose and --quiet exclude each other")

    @property
    def mode(self) -> str:
        """The console's mode (:class:`~speculators_v016.run.console.Console`)."""
        return "verbose" if self.verbose else "quiet" if self.quiet else "normal"


@dataclass(frozen=True, kw_only=True)
class CheckConfig:
    """``speculators-data-gen check``: a few samples through the engine, their states checked against vLLM's
    logits, each layer replayed in transformers, and the whole model in transformers where it fits."""

    engine: EngineConfig
    train_data_path: tuple[str, ...] = setting(
        MISSING, "Dataset, as the run's --train-data-path. Repeat to combine.", section=INPUT, required=True
    )
    samples: int = setting(4, "How many samples to compare.", section=INPUT, min=1)
    seq_length: int = setting(512, "Longest sample in tokens; longer ones are truncated.", section=INPUT, min=1)
    layer_ids: tuple[int, ...] | None = setting(
        None, "Layers to check, as the run's --layer-ids (default: the run's default).", section=INPUT, kind="layer_ids"
    )
    transformers: bool = setting(
        True,
        "Skip the whole-model comparison with transformers (targets that do not fit in memory "
        "here); the logit check (final norm + lm_head vs vLLM's logits) and the layer replay (one "
        "layer's weights at a time) still run.",
        option="--no-transformers",
        negate=True,
        section=CHECKS,
    )

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def build(cls, engine: Mapping[str, Any], **check: Any) -> CheckConfig:
        """The check's config: the engine's ``max_model_len`` derived from ``seq_length``, once."""
        seq_length = check.get("seq_length", default_of(cls, "seq_length"))
        return cls(engine=EngineConfig.for_seq_length(seq_length, **engine), **check)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """``speculators-data-gen serve``: the capture engine as a long-lived service; clients ask for samples,
    each sample's states are published to a folder and answered with a handle (docs/online.md)."""

    engine: EngineConfig
    backend: ServeBackend = setting(
        "folder",
        "Where the states are published: folder (--serve-dir) or mooncake (the Mooncake store, --mooncake-master).",
        section=SERVICE,
    )
    serve_dir: Path | None = setting(
        None,
        "Folder of --backend folder (/dev/shm/NAME or local NVMe on one node, a shared filesystem across "
        "nodes): an empty folder or one an earlier service of ours used.",
        section=SERVICE,
        kind="dir",
    )
    mooncake_master: str = setting(
        "auto",
        "Master of --backend mooncake: HOST:PORT of a running mooncake_master, or auto (one started beside the "
        "service, on --host).",
        section=SERVICE,
    )
    host: str = setting("127.0.0.1", "Address to listen on (0.0.0.0: every interface).", section=SERVICE)
    port: int = setting(8471, "Port to listen on (0: any free one, printed at start).", section=SERVICE, min=0)
    api_key: str | None = setting(
        None,
        "Key every request but GET /health must carry (Authorization: Bearer KEY; 401 otherwise). Prefer its "
        "variable or --api-key-file: an option is visible in the process list.",
        section=SERVICE,
    )
    api_key_file: str | None = setting(
        None, "File whose first line is --api-key (the key stays out of the process list).", section=SERVICE
    )
    max_connections: int = setting(
        256,
        "HTTP connections held at once (a thread each); a newcomer takes the place of one waiting for its request "
        "(never keyed first, then the longest idle), or is answered 503 where every one is being served.",
        section=SERVICE,
        min=1,
    )
    read_timeout: float = setting(
        30.0,
        "Seconds a client has to send a request (its line, headers and body); a slower one is cut.",
        section=SERVICE,
        min=0,
        min_open=True,
    )
    header_timeout: float = setting(
        10.0,
        "Seconds a connection has to send a request's line and headers, from its opening or its previous answer "
        "(at most --read-timeout); an idle or slower one is cut.",
        section=SERVICE,
        min=0,
        min_open=True,
    )
    max_pending: int = setting(
        64, "Requests in the engine or being published at most; more wait (backpressure).", section=SERVICE, min=1
    )
    max_published_bytes: int = setting(
        8 << 30,
        "Bytes published and not yet taken by a consumer at most; publishing waits below it (backpressure).",
        section=SERVICE,
        min=1,
    )
    lease_seconds: float = setting(
        3600.0,
        "A published sample no consumer took within this many seconds is reclaimed (a consumer on this host "
        "that died: at once).",
        section=SERVICE,
        min=0,
        min_open=True,
    )
    served_model_name: str | None = setting(
        None,
        "The model's name to upstream 0.9.0's client (/v1/models; it must equal the verifier name its trainer is "
        "given). Default: --target-model-path as given.",
        section=SERVICE,
    )
    train_data_path: tuple[str, ...] = setting(
        (),
        "Dataset whose samples clients may ask for by index (as the run's --train-data-path); without it "
        "clients send token ids.",
        section=INPUT,
    )
    seq_length: int = setting(2048, "Longest sample in tokens; longer ones are truncated.", section=INPUT, min=1)
    max_samples: int | None = setting(None, "Use at most this many rows (after shuffling).", section=INPUT, min=1)
    layer_ids: tuple[int, ...] | None = setting(
        None, "Layers to capture, as the run's --layer-ids.", section=INPUT, kind="layer_ids"
    )
    seed: int = setting(0, "Shuffle seed of --train-data-path, as the run's.", section=INPUT)
    num_preprocessing_workers: int = setting(8, "Processes for tokenization.", section=INPUT, min=1)
    write_workers: int = setting(
        DEFAULT_WRITE_WORKERS, "Threads publishing sample files (half the cores, from 4 to 8).", section=OUTPUT, min=1
    )
    logit_check_samples: int = setting(
        4,
        "First requests whose captured last layer, normed and projected, must reproduce vLLM's own prompt "
        "logprobs before anything is published (0: off).",
        section=CHECKS,
        min=0,
    )

    def __post_init__(self) -> None:
        _check(self)
        if self.backend == "folder" and self.serve_dir is None:
            raise ConfigError("--backend folder publishes to a folder: give --serve-dir", "--serve-dir")
        if self.backend != "folder" and self.serve_dir is not None:
            raise ConfigError(f"--serve-dir is the folder backend's; --backend {self.backend} does not use it")
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("give --api-key or --api-key-file, not both", "--api-key-file")

    @classmethod
    def build(cls, engine: Mapping[str, Any], **serve: Any) -> ServeConfig:
        """The service's config: the engine's ``max_model_len`` and seed from ``seq_length`` and ``seed``, once;
        ``tensor_parallel_size`` None: the visible GPUs (or 1)."""
        engine = dict(engine)
        if engine.get("tensor_parallel_size") is None:
            engine["tensor_parallel_size"] = visible_gpus()
        seq_length, seed = serve.get("seq_length", default_of(cls, "seq_length")), serve.get("seed", 0)
        return cls(engine=EngineConfig.for_seq_length(seq_length, seed=seed, **engine), **serve)


#: The options of each command: (class, the fields that are options (None: every field with a section),
#: per-field overrides of their metadata). A field is an option of the main command once it has a section.
MAIN_OPTIONS = ((EngineConfig, None, {}), (RunConfig, None, {}), (ConsoleConfig, None, {}))
CHECK_OPTIONS = (
    (
        EngineConfig,
        (
            "model",
            "trust_remote_code",
            "dtype",
            "enforce_eager",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "extra_engine_args",
        ),  # fmt: skip
        {
            "model": {"required": True},
            "dtype": {"help": "The engine's dtype (transformers runs in fp32)."},
            "tensor_parallel_size": {"cli_default": 1, "help": "GPUs per model."},
        },
    ),
    (CheckConfig, None, {}),
)


def option_fields(command: tuple = MAIN_OPTIONS) -> tuple[Field, ...]:
    """``command``'s options, in --help's order: by section, then as declared."""
    fields = []
    for cls, names, overrides in command:
        for f in fields_of(cls):
            if f.is_option and (names is None or f.name in names):
                override = overrides.get(f.name)
                fields.append(dataclasses.replace(f, meta={**f.meta, **override}) if override else f)
    return tuple(sorted(fields, key=lambda f: SECTIONS.index(f.meta["section"])))


def env_name(flag: str, command: str | None = None) -> str:
    """The environment variable of option ``flag`` (of subcommand ``command``; None: the main command):
    ``SPECULATORS_DATA_GEN_[COMMAND_]OPTION``, dashes as underscores, upper case."""
    parts = [ENV_PREFIX] + ([command] if command else []) + [flag.lstrip("-")]
    return "_".join(parts).replace("-", "_").upper()


def default_of(cls: type, name: str) -> Any:
    """Field ``name``'s default in ``cls`` (for signatures that repeat a field, e.g. the generator's)."""
    return next(f.default for f in fields_of(cls) if f.name == name)


# -- the other subcommands ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """``speculators-data-gen verify DIRECTORY``: a run's folder read back (speculators_v016.store.verify)."""

    directory: Path = setting(MISSING, "The run's --output-dir, with its shard-* folders (the command's argument).")
    partial: bool = setting(False, "Check what is there, not that the run is complete.", section=CHECKS)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class DemoConfig:
    """``speculators-data-gen demo``: the whole pipeline on a tiny random model (speculators_v016.run.demo)."""

    directory: Path = setting(
        Path("speculators-demo"), "Where the tiny model and the data go.", option="--dir", section=OUTPUT, kind="dir"
    )
    format: SampleFormat = setting("safetensors", "The samples' format, as the run's --format.", section=OUTPUT)

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class CleanShmConfig:
    """``speculators-data-gen clean-shm``: the shared memory dead runs recorded, listed or deleted
    (speculators_v016.shared.shm_records)."""

    yes: bool = setting(False, "Delete what is listed (without it: only list).", section=OUTPUT)
    shm_dir: str = setting(
        "/dev/shm", "The shared-memory folder to look in (tests give their own).", section=OUTPUT, hidden=True
    )

    def __post_init__(self) -> None:
        _check(self)


#: Their options, as MAIN_OPTIONS gives the main command's.
VERIFY_OPTIONS = ((VerifyConfig, None, {}),)
DEMO_OPTIONS = ((DemoConfig, None, {}),)
CLEAN_SHM_OPTIONS = ((CleanShmConfig, None, {}),)
SERVE_OPTIONS = (
    (EngineConfig, None, {"model": {"required": True}}),
    (ServeConfig, None, {}),
)
