"""The engine's settings: one object, built once (by the CLI or the generator's keywords), passed whole.

Every default lives here, as a named constant, and nowhere else: the CLI's
option defaults, :class:`~speculators_v016.generator.VllmHiddenStatesGenerator`'s
keywords and the engine all read these. The engine turns an
:class:`EngineSettings` into vLLM's ``EngineArgs`` field by field
(:meth:`speculators_v016.engine.core.CaptureEngine`), as vLLM passes one
``VllmConfig`` down its own stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_GPU_MEMORY_UTILIZATION = 0.8
#: ``max_num_batched_tokens`` when not given: at least this, and at least ``max_model_len``.
MIN_DEFAULT_BATCHED_TOKENS = 8192
#: Defaults of the run (upstream's data_generation_offline.py defaults where it had the option).
DEFAULT_SEQ_LENGTH = 2048
DEFAULT_BATCH_SIZE = 8
DEFAULT_WRITE_WORKERS = 4  # tools/benchmarks/host_path.py: 2 workers leave part of the disk idle, 4 reach it
#: Nice levels the writer threads run below the process: where cores are contended the engine's
#: thread (and a CPU engine's forward) gets them first, the writers what is left behind their bounded queue.
WRITER_NICE_INCREMENT = 10
#: Torch threads for the engine's copy of each step out of its ring slot (GPU engines; a CPU engine's
#: threads are vLLM's, bound to its cores). On an H200 host (16 cores) a 448 MiB step took 11 ms with
#: torch's 16 threads on an idle host but 128 ms while 4 writers hashed (one busy core stalls the whole
#: parallel copy), 25 ms with 4 threads either way, 80 ms with the 1 thread vLLM's mp executor leaves.
DEFAULT_COPY_THREADS = 4
DEFAULT_LOGIT_CHECK_SAMPLES = 4
DEFAULT_MAX_BAD_SAMPLES = 10
DEFAULT_PREPROCESSING_WORKERS = 8
DEFAULT_TOKEN_FREQ_PATH = "./token_freq.pt"
EXECUTORS = ("uni", "mp", "ray")
CAPTURE_MODES = ("auto", "taps")
#: How hidden states are stored: "auto" in the engine's dtype; "fp8_e4m3": e4m3 codes + a float32 scale
#: per token per layer, quantized in the worker's capture (speculators_v016.fp8).
HIDDEN_STATES_DTYPES = ("auto", "fp8_e4m3")


@dataclass
class EngineSettings:
    """What the capture engine needs to start vLLM 0.16 (the layer plan travels beside it)."""

    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_batched_tokens: int | None = None  # None: max(MIN_DEFAULT_BATCHED_TOKENS, max_model_len)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    async_scheduling: bool = True
    enforce_eager: bool = False
    dtype: str = "auto"
    executor: str | None = None  # one of EXECUTORS; None: vLLM's choice
    trust_remote_code: bool = False
    seed: int = 0
    capture_mode: str = "auto"  # "auto": built-in aux outputs where vLLM has them; "taps": ours only
    hidden_states_dtype: str = "auto"  # one of HIDDEN_STATES_DTYPES
    extra_engine_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.executor is not None and self.executor not in EXECUTORS:
            raise ValueError(f"executor {self.executor!r}: choose from {EXECUTORS}")
        if self.capture_mode not in CAPTURE_MODES:
            raise ValueError(f"capture_mode {self.capture_mode!r}: choose from {CAPTURE_MODES}")
        if self.hidden_states_dtype not in HIDDEN_STATES_DTYPES:
            raise ValueError(f"hidden_states_dtype {self.hidden_states_dtype!r}: choose from {HIDDEN_STATES_DTYPES}")

    @property
    def fp8(self) -> bool:
        """Hidden states stored as FP8 codes and scales."""
        return self.hidden_states_dtype == "fp8_e4m3"

    @property
    def batched_tokens(self) -> int:
        """``max_num_batched_tokens``, with its default resolved."""
        return self.max_num_batched_tokens or max(MIN_DEFAULT_BATCHED_TOKENS, self.max_model_len)
