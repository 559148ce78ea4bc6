"""What the engine and the workers exchange: the set-up (once), the ring's description, each step's capture.

The engine sends one :class:`WorkerSetup` to every worker, through the set-up
RPC, right after vLLM loaded the model: the capture's config, the output rank
and the ring. A setting keeps its name on the way: ``--hidden-states-dtype`` is
``EngineConfig.hidden_states_dtype``, ``CaptureConfig.hidden_states_dtype`` and
``RingSpec.hidden_states_dtype``.

Both sides import this module (and :mod:`speculators_v016.shared`, the ring) and
nothing of each other, so the engine side never loads worker code (aux outputs,
CPU shims) and the worker side never loads the engine loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
PREFIX = "speculators-v016-ring-"


_ALIGN = 64  # bytes: every slot and every scales block starts on a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class RingSpec:
    """What a worker needs to map the ring (sent through the set-up RPC).

    A shared ring's file starts with a header that repeats the shape and the
    creator's random ``token``: the worker maps the file only if both match
    (a name that vanished or was replaced fails the run, never maps zeros).

    A slot is one block of bytes: the states ``[num_ids, max_rows, hidden]``
    (the engine's dtype, or e4m3 codes with ``hidden_states_dtype="fp8_e4m3"``), then,
    for FP8 only, the scales ``[num_ids, max_rows]`` float32 at
    :attr:`scales_offset`. Slots and scale blocks start on 64-byte boundaries.
    """

    name: str
    shared: bool
    slots: int
    num_ids: int
    max_rows: int
    hidden: int
    dtype: str  # the engine's dtype, e.g. "bfloat16": what the model's aux states are
    token: str = ""  # hex; the creator's identity token (shared rings)
    directory: str = SHM_DIR  # where a shared ring's file lies
    hidden_states_dtype: str = "auto"  # "auto": states stored in ``dtype``; "fp8_e4m3": codes + scales

    @property
    def torch_dtype(self) -> torch.dtype:
        """The engine's dtype (what the worker's aux states must be)."""
        import torch  # noqa: PLC0415 - torch only for dtypes: clean-shm loads this module without torch

        return getattr(torch, self.dtype)

    @property
    def fp8(self) -> bool:
        return self.hidden_states_dtype == "fp8_e4m3"

    @property
    def state_dtype(self) -> torch.dtype:
        """What a slot's states hold: the engine's dtype, or e4m3 codes."""
        import torch  # noqa: PLC0415 - torch only for dtypes: clean-shm loads this module without torch

        return torch.float8_e4m3fn if self.fp8 else self.torch_dtype

    @property
    def slot_numel(self) -> int:
        return self.num_ids * self.max_rows * self.hidden

    @property
    def states_bytes(self) -> int:
        return self.slot_numel * self.state_dtype.itemsize

    @property
    def scales_offset(self) -> int:
        return _aligned(self.states_bytes)

    @property
    def scales_bytes(self) -> int:
        return self.num_ids * self.max_rows * 4 if self.fp8 else 0

    @property
    def slot_bytes(self) -> int:
        return _aligned(self.scales_offset + self.scales_bytes) if self.fp8 else _aligned(self.states_bytes)

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def describe(self) -> str:
        per_row = (
            f"(x {self.hidden} e4m3 + 4 scale bytes)"
            if self.fp8
            else f"x {self.hidden} hidden x {self.states_bytes // self.slot_numel} bytes"
        )
        return (
            f"{self.slots} slots x {self.max_rows} rows x {self.num_ids} layers {per_row} "
            f"= {self.total_bytes / 2**20:,.0f} MiB"
        )


@dataclass(frozen=True)
class CaptureConfig:
    """What the capture does, the same in every worker (built by the engine from its
    :class:`~speculators_v016.config.EngineConfig` and layer plan; also in vLLM's
    ``additional_config``, so compiled graphs cached without these ids are never reused).
    """

    capture_ids: tuple[int, ...]  # vLLM aux ids, in capture order
    capture_mode: str = "auto"  # see speculators_v016.config.CaptureMode
    hidden_states_dtype: str = "auto"  # see speculators_v016.config.HiddenStatesDtype

    @property
    def fp8(self) -> bool:
        return self.hidden_states_dtype == "fp8_e4m3"

    def as_dict(self) -> dict:
        """The config as vLLM's ``additional_config`` entry (JSON: its compile-cache hash)."""
        return {
            "capture_ids": list(self.capture_ids),
            "capture_mode": self.capture_mode,
            "hidden_states_dtype": self.hidden_states_dtype,
        }


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker needs for the capture, sent once (the set-up RPC's one argument).

    ``staging``: ``"auto"`` stages on the GPU where it fits, ``"off"`` keeps
    direct copies (benchmarks and tests compare the two).
    """

    capture: CaptureConfig
    output_rank: int  # the rank that replies with vLLM's model output (last stage, TP rank 0)
    ring: RingSpec | None = None  # None: the states travel in the reply (Ray)
    staging: str = "auto"
    #: the ranks that capture and reply with captures: TP rank 0 of every pipeline stage, in stage order
    #: (empty: the output rank alone, as without pipeline parallelism)
    capture_ranks: tuple[int, ...] = ()
    #: GPU staging buffers: one per step in flight (0: one fewer than the ring's slots)
    staging_buffers: int = 0
    #: the output rank hands its aux states over as they are, no ring and no copy (an in-process CPU engine:
    #: :mod:`~speculators_v016.worker.held_states`); ``StepCapture.states`` is then one tensor per layer
    by_reference: bool = False
    #: the pid of the process driving the engine (0: not said): a worker in another process is one of vLLM's,
    #: which freezes its objects at exit (:mod:`~speculators_v016.shared.exit_gc`)
    driver_pid: int = 0

    @property
    def capturing_ranks(self) -> tuple[int, ...]:
        return self.capture_ranks or (self.output_rank,)


@dataclass
class StepCapture:
    """The aux states of one step, in the runner's batch order.

    ``states`` is ``[num_capture_ids, rows, hidden]``: in the reply it is None
    when the rows sit in ring slot ``slot`` (the engine fills it in with a view
    of the slot); with no ring it is a host tensor; handed over by reference
    (``WorkerSetup.by_reference``) a list of one ``[rows, hidden]`` tensor per
    captured layer, the model's own. With FP8 storage
    ``states`` holds the e4m3 codes and ``scales`` (``[num_capture_ids,
    rows]`` float32) one scale per row; otherwise ``scales`` is None.

    Under pipeline parallelism every stage replies with the layers it holds:
    ``layers`` = ``(first, end)``, the rows ``first .. end - 1`` of the captured
    stack (of the slot, or of ``states`` without a ring, which then holds only
    those); ``stage`` is the pipeline rank. Without it, ``layers`` is None: all of them.

    ``finite`` is True when the device proved every value of the step's rows
    finite as they left it (the float32 sum of the staged bytes is finite:
    :mod:`~speculators_v016.worker.staging`); None when nothing was proven
    (CPU engines, the direct path, FP8 storage), and the writer tests the bytes.

    ``placed`` names the requests whose rows the worker copied straight into the
    destinations the engine gave it for this step (:class:`RowPlacement`), not
    into the slot; the slot's rows of those requests are left as they were.
    """

    step: int
    req_ids: list[str]
    starts: list[int]  # position in the prompt of each request's first row
    counts: list[int]  # rows per request
    slot: int | None = None
    states: torch.Tensor | list[torch.Tensor] | None = None
    scales: torch.Tensor | None = None
    layers: tuple[int, int] | None = None  # rows of the captured stack this reply filled (None: all)
    stage: int = 0  # the pipeline stage that captured them
    finite: bool | None = None  # True: the device proved every value of these rows finite (None: not proven)
    placed: list[str] | None = None  # requests whose rows went to their RowPlacement, not to the slot


@dataclass
class RowPlacement:
    """Where one request's rows of one step go, straight from the worker: the request's own tensors.

    Only an in-process worker (the uniprocess executor) receives them: the destinations are this process's
    memory, never pickled. The worker places a request only where its own attribution of the step agrees
    (the request's first row at ``start``, at least ``count`` rows); the engine checks that attribution
    against the scheduler's as for every step, and refuses a step whose placed requests differ from
    those it asked for. On GPUs the destinations are registered (pinned) memory that outlives the copy.
    """

    start: int  # the request's first position among the step's rows
    count: int  # rows placed (the step may hold more of it: rows past its prompt, which nobody keeps)
    #: per requested layer: (its row of the captured stack, the ``[count, hidden]`` destination, with FP8
    #: storage the ``[count]`` float32 scales' destination, else None)
    layers: list[tuple[int, torch.Tensor, torch.Tensor | None]]
