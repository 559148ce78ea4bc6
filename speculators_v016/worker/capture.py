"""Worker side of the capture: set up aux outputs, and hand each step's states over.

vLLM mixes :class:`CaptureWorkerExtension` into its worker class
(``worker_extension_cls``), so these methods run in every worker process and
are reached with ``collective_rpc``. Method names carry a ``speculators_``
prefix: an extension may not redefine a worker method.

Between ``execute_model`` and ``sample_tokens`` of step ``k`` the worker
captures the step into the ring slot the engine gave it: in the same RPC as
``sample_tokens`` (:meth:`~CaptureWorkerExtension.speculators_capture_sample`,
uniprocess and multiprocess executors), or in one of its own
(:meth:`~CaptureWorkerExtension.speculators_capture_step`, Ray). On the
output rank the step's aux states (only the scheduled tokens, no padding) are
copied into the slot, one contiguous copy per layer.
On GPUs the ring is registered once as pinned memory and the copy takes one
of two paths, chosen at set-up (:func:`~speculators_v016.worker.staging.plan_staging`)
and reported in the set-up info (``copy_path``):

* ``staged``: a device-to-device copy into a GPU staging buffer on the
  compute stream, then the device-to-host copy on a dedicated copy stream
  (:class:`~speculators_v016.worker.staging.StagingCopier`), so the next
  forward does not wait for PCIe. The staging bytes are added to the
  runner's ``model_memory_usage`` before vLLM sizes the KV cache.
* ``direct`` (the fallback, when staging does not fit): the device-to-host
  copy enqueued on the compute stream.

Either way the copy is ordered after the step's forward and before the next
forward overwrites any buffer (CUDA graphs reuse theirs). On CPU it is a
plain copy, or, in an in-process CPU engine (``WorkerSetup.by_reference``),
none: the step's aux states are handed to the engine's thread as they are
(``reference``), checked not to lie in memory an earlier step's states still
use (:mod:`~speculators_v016.worker.held_states`). The reply is the *previous* step's metadata
(:class:`StepCapture`: slot, request ids, starts, counts), waiting for its
copy into the slot to complete (with ``speculators_capture_sample``, on vLLM's
output thread, beside the sampled tokens): the host thread never waits for
the step still running, and no state crosses the process boundary by pickling. Other
ranks return nothing. Without a ring (the Ray executor, whose workers may sit
on other hosts) the states travel in the reply, as a host tensor (direct
path).

:meth:`~CaptureWorkerExtension.speculators_capture_close` releases what the
capture holds (staging buffers, the ring's pinned registration); the engine's
executor calls it before vLLM shuts down, a re-attach calls it first, and the
ring's finalizer unregisters on any other exit path.

Under pipeline parallelism (:mod:`~speculators_v016.worker.pipeline_stage`) TP
rank 0 of every stage captures: its stage's layers only, into their rows of
the slot (:class:`StageShare`), each reply naming the rows it filled; a stage
before the last reads the aux list its forward returned, which vLLM's runner
does not keep there.

With FP8 storage (``--hidden-states-dtype fp8_e4m3``) each layer's rows are
quantized here (:mod:`speculators_v016.fp8`: e4m3 codes, one float32 scale
per row) before they leave the device, and the slot holds codes and scales:
``staged``, the quantization is the device-to-device step (into staging
buffers of codes and scales); ``direct``, it writes a device buffer of one
layer on the compute stream, which the device-to-host copy then reads (the
stream orders the next layer's quantization after that copy); on CPU it
writes straight into the slot. Half the bytes cross PCIe, the ring and the
host.

On the ``staged`` path the step's rows (with FP8 storage: their scales) are
also summed in float32 on the device, and the sum lands in the slot's proof
(pinned host memory) with the rows: the reply's ``StepCapture.finite`` is
True when it is finite, which proves every value finite
(:mod:`~speculators_v016.worker.staging`), so the writers skip their NaN/Inf
test of those bytes. Every other path leaves it None, and the writers test
the bytes.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from speculators_v016 import fp8
from speculators_v016.protocol import RingSpec, StepCapture, WorkerSetup
from speculators_v016.shared import exit_gc
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.worker import cpu_async, cpu_rope
from speculators_v016.worker.aux_outputs import find_decoder_stack, install_aux_outputs
from speculators_v016.worker.check_forward import engine_check_forward
from speculators_v016.worker.cpu_seeds import discarded_generators_aside
from speculators_v016.worker.held_states import HeldStates
from speculators_v016.worker.pipeline_stage import LastForwardAux, StageLayers, keep_prompt_rows, stage_of
from speculators_v016.worker.row_placement import destinations, split_rows
from speculators_v016.worker.staging import Fp8Buffers, StagingCopier, StagingPlan, plan_staging


@dataclass
class _Pending:
    capture: StepCapture
    ready: torch.cuda.Event | None
    proof: torch.Tensor | None = None  # the rows' float32 sum, landed with them (staged path): the NaN/Inf proof

    def result(self) -> StepCapture:
        if self.ready is not None:
            self.ready.synchronize()
        if self.proof is not None:
            self.capture.finite = math.isfinite(float(self.proof))
        return self.capture


@functools.cache
def _paired_class() -> type:
    """vLLM's async output type, carrying a step's model output and the previous step's capture."""
    from vllm.v1.outputs import AsyncModelRunnerOutput  # noqa: PLC0415 - vLLM: tests/gpu run without it

    class PairedOutput(AsyncModelRunnerOutput):
        def __init__(self, output: Any, pending: _Pending | None):
            self._output, self._pending = output, pending

        def get_output(self) -> tuple[Any, StepCapture | None]:
            output = self._output
            if isinstance(output, AsyncModelRunnerOutput):
                output = output.get_output()
            return output, (self._pending.result() if self._pending is not None else None)

    return PairedOutput


def paired_output(output: Any, pending: _Pending | None) -> Any:
    """``output`` (vLLM's, async or not) and ``pending`` as one async output: vLLM's executors call
    its ``get_output`` (on their output thread with async scheduling) before the reply is sent."""
    return _paired_class()(output, pending)


@dataclass
class StageShare:
    """A pipeline stage's part of the capture: its rows of the captured stack, and where its aux states come
    from (a stage before the last: :class:`~speculators_v016.worker.pipeline_stage.LastForwardAux`)."""

    stage: StageLayers
    rows: tuple[int, int]
    aux: LastForwardAux | None
    keeps_prompt_rows: bool

    @property
    def rank(self) -> int:
        return self.stage.rank

    @classmethod
    def set_up(cls, runner: Any, stage: StageLayers, rows: tuple[int, int], ids: list) -> StageShare:
        aux = LastForwardAux(runner) if ids and not stage.is_last else None
        fix = bool(runner.use_async_scheduling) and not stage.is_last
        if fix:  # vLLM 0.16's lost prompt tokens (speculators_v016.worker.pipeline_stage, 3)
            keep_prompt_rows(runner)
        return cls(stage, rows, aux, fix)


class HostCopy:
    """``host``: a CPU worker copies each layer's scheduled rows straight into host memory; done on return.

    Every copier takes the step's ``ranges`` of rows for the slot (``dst``; None: all of them) and the
    ``segments`` of placed requests (:func:`~speculators_v016.worker.row_placement.split_rows`)."""

    name = "host"

    def copy(self, aux, total: int, dst: torch.Tensor, dst_scales, segments=(), ranges=None) -> None:
        for j, layer in enumerate(aux):  # one contiguous copy per layer and range, no intermediate buffer
            for a, b in [(0, total)] if ranges is None else ranges:
                dst[j, a:b].copy_(layer[a:b], non_blocking=False)
            for first, count, to, _ in destinations(segments, j):
                to.copy_(layer[first : first + count], non_blocking=False)


class HostQuantize(HostCopy):
    """``host`` with FP8 storage: each layer quantized straight into the slot (codes and scales), or into
    a placed request's tensors (one scale per row: a row's codes do not depend on the rows beside it)."""

    def copy(self, aux, total: int, dst: torch.Tensor, dst_scales, segments=(), ranges=None) -> None:
        for j, layer in enumerate(aux):
            for a, b in [(0, total)] if ranges is None else ranges:
                fp8.quantize_into(layer[a:b], dst[j, a:b], dst_scales[j, a:b])
            for first, count, to, to_scales in destinations(segments, j):
                fp8.quantize_into(layer[first : first + count], to, to_scales)


class Reference:
    """``reference``: an in-process CPU engine reads the step's aux states themselves (no ring, no copy)."""

    name = "reference"


class DirectCopy:
    """``direct``: device-to-host copies enqueued on the compute stream; the event orders them before the next
    forward and tells the reply when they landed."""

    name = "direct"

    def copy(self, aux, total: int, dst: torch.Tensor, dst_scales, segments=(), ranges=None) -> torch.cuda.Event:
        for j, layer in enumerate(aux):
            for a, b in [(0, total)] if ranges is None else ranges:
                dst[j, a:b].copy_(layer[a:b], non_blocking=True)
            for first, count, to, _ in destinations(segments, j):
                to.copy_(layer[first : first + count], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: the copy is ordered before the next forward
        return ready


class DirectQuantize(DirectCopy):
    """``direct`` with FP8 storage: each layer quantized into a device buffer of one layer on the compute
    stream, which the device-to-host copy reads (the stream orders the next layer's quantization after it)."""

    def __init__(self, buffers: Fp8Buffers | None = None):
        self.buffers = buffers  # allocated at set-up where the ring bounds the rows; else grown on demand

    def copy(self, aux, total: int, dst: torch.Tensor, dst_scales, segments=(), ranges=None) -> torch.cuda.Event:
        codes, scales = self._buffer(total, aux[0].shape[-1], aux[0].device)
        for j, layer in enumerate(aux):  # compute stream: quantize, then copy codes and scales to the host
            fp8.quantize_into(layer[:total], codes, scales)
            for a, b in [(0, total)] if ranges is None else ranges:
                dst[j, a:b].copy_(codes[a:b], non_blocking=True)
                dst_scales[j, a:b].copy_(scales[a:b], non_blocking=True)
            for first, count, to, to_scales in destinations(segments, j):
                to.copy_(codes[first : first + count], non_blocking=True)
                to_scales.copy_(scales[first : first + count], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def _buffer(self, rows: int, hidden: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Device codes ``[rows, hidden]`` and scales ``[rows]`` of one layer (kept)."""
        have = self.buffers
        if have is None or have.codes.shape[1] < rows or have.codes.shape[2] != hidden:  # no ring: grow
            have = self.buffers = Fp8Buffers(
                torch.empty((1, rows, hidden), dtype=fp8.CODE_DTYPE, device=device),
                torch.empty((1, rows), dtype=fp8.SCALE_DTYPE, device=device),
            )
        return have.codes[0, :rows], have.scales[0, :rows]


class StagedCopy:
    """``staged``: into a GPU staging buffer on the compute stream (quantized there with FP8 storage), then
    device-to-host on the copy stream (:class:`~speculators_v016.worker.staging.StagingCopier`); the event
    is on the copy stream."""

    name = "staged"

    def __init__(self, staging: StagingCopier, fp8_storage: bool):
        self.staging, self.fp8 = staging, fp8_storage

    def copy(self, aux, total: int, dst: torch.Tensor, dst_scales, segments=(), ranges=None, proof=None) -> Any:
        return self.staging.copy(aux, total, Fp8Buffers(dst, dst_scales) if self.fp8 else dst, proof, segments, ranges)

    def close(self) -> None:
        self.staging.close()


class Capture:
    """One worker's capture, set up once from a :class:`~speculators_v016.protocol.WorkerSetup`: the ring
    mapped (output rank), the copy path chosen, the step still pending. :class:`CaptureWorkerExtension`
    holds one; attaching again closes it and makes a new one."""

    def __init__(self, worker: Any, setup: WorkerSetup, accounted: int = 0):
        capture, ring = setup.capture, setup.ring
        if setup.staging not in ("auto", "off"):
            raise ValueError(f"staging {setup.staging!r}: choose 'auto' or 'off'")
        if capture.hidden_states_dtype not in ("auto", fp8.NAME):
            raise ValueError(f"hidden_states_dtype {capture.hidden_states_dtype!r}: expected 'auto' or {fp8.NAME!r}")
        if ring is not None and ring.hidden_states_dtype != capture.hidden_states_dtype:
            raise RuntimeError(
                f"the capture ring stores {ring.hidden_states_dtype!r}, "
                f"the capture was set up for {capture.hidden_states_dtype!r}"
            )
        runner = worker.model_runner
        device = runner.device
        stage: StageShare | None = getattr(worker, "_speculators_stage", None)
        #: the rows of the captured stack this worker fills: all, or its pipeline stage's (maybe none)
        self.rows = stage.rows if stage is not None else (0, len(capture.capture_ids))
        self.stage = stage
        self.is_output = worker.rank in setup.capturing_ranks and self.rows[1] > self.rows[0]
        self.num_ids = self.rows[1] - self.rows[0]
        self.fp8 = capture.fp8
        self.pin = device.type == "cuda"  # new host tensors (no ring) are pinned for the device's copies
        self.pending: _Pending | None = None
        self.ring: SlotRing | None = None
        self.closed = False
        self.accounted = accounted  # bytes counted into the runner's model_memory_usage
        self.copier = None if not self.is_output else DirectCopy() if device.type == "cuda" else HostCopy()
        if self.fp8 and self.copier is not None:
            self.copier = DirectQuantize() if device.type == "cuda" else HostQuantize()
        self.held: HeldStates | None = None
        #: staged: each ring slot's NaN/Inf proof (pinned host float32; None: none made)
        self.proofs: torch.Tensor | None = None
        if setup.by_reference and self.copier is not None:
            if device.type != "cpu" or self.fp8 or ring is not None or stage is not None:
                raise ValueError(
                    "aux states are handed over by reference only by an in-process CPU engine storing the "
                    f"engine's dtype, without a ring or pipeline stages (device {device.type}, "
                    f"hidden_states_dtype {capture.hidden_states_dtype!r}, ring {ring is not None}, "
                    f"stage {stage is not None})"
                )
            self.copier, self.held = Reference(), HeldStates()
        self.copy_info: dict = {"copy_path": self.copier.name if self.copier is not None else "none"}
        if not (self.is_output and ring is not None):
            return
        self.ring = SlotRing.attach(ring)
        if device.type != "cuda":
            return
        self.ring.pin()
        plan = self._plan_staging(worker, ring, device, setup.staging, self.num_ids, setup.staging_buffers)
        staging = None
        if plan.use:
            try:
                staging = StagingCopier(
                    plan, (self.num_ids, ring.max_rows, ring.hidden), ring.torch_dtype, device, fp8=self.fp8
                )
            except torch.cuda.OutOfMemoryError as exc:
                plan = StagingPlan(
                    False,
                    plan.buffers,
                    plan.buffer_bytes,
                    f"staging buffers could not be allocated ({exc}): direct copies",
                )
        if self.fp8:
            fp8.warm_up(ring.hidden, ring.torch_dtype, device)  # the kernel compiled before the run's clock
        quant_bytes = 0
        if staging is not None:
            self.copier = StagedCopy(staging, self.fp8)
            self.proofs = torch.zeros(ring.slots, dtype=torch.float32, pin_memory=True)
        elif self.fp8:  # allocated now, before vLLM profiles memory
            self.copier = DirectQuantize(
                Fp8Buffers(
                    torch.empty((1, ring.max_rows, ring.hidden), dtype=fp8.CODE_DTYPE, device=device),
                    torch.empty((1, ring.max_rows), dtype=fp8.SCALE_DTYPE, device=device),
                )
            )
            quant_bytes = ring.max_rows * (ring.hidden + 4)
        self.copy_info = {
            "copy_path": self.copier.name,
            "staging": plan.describe(),
            **({"staging_fill": staging.fill_path} if staging is not None else {}),
            "staging_in_model_memory": self._account(runner, plan, quant_bytes),
        }

    @staticmethod
    def _plan_staging(
        worker: Any, ring: RingSpec, device: torch.device, staging: str, num_ids: int, in_flight: int = 0
    ) -> StagingPlan:
        """One staging buffer per step in flight (``in_flight``; 0: the ring's slots less one), if it fits (see
        plan_staging); a buffer holds this worker's layers (a pipeline stage's share of a slot)."""
        buffers = in_flight or max(ring.slots - 1, 1)
        slot_bytes = -(-ring.slot_bytes * num_ids // ring.num_ids)
        if staging == "off":
            return StagingPlan(False, buffers, slot_bytes, "staging turned off: direct copies")
        free, total = torch.cuda.mem_get_info(device)
        requested, init = getattr(worker, "requested_memory", None), getattr(worker, "init_snapshot", None)
        budget_left = None
        if requested is not None and init is not None:
            # vLLM's budget (total x gpu_memory_utilization) minus what this instance took since its
            # start-up snapshot (weights, NCCL, ...): what the activations and the KV cache will share.
            budget_left = int(requested) - ((total - free) - int(init.cuda_memory))
        return plan_staging(buffers, slot_bytes, free, budget_left)

    def _account(self, runner: Any, plan: StagingPlan, extra: int = 0) -> bool:
        """Count the staging bytes (and ``extra``: FP8's one-layer buffer of the direct path) as model
        memory, which vLLM subtracts before it sizes the KV cache."""
        if not hasattr(runner, "model_memory_usage"):
            return False
        nbytes = (plan.nbytes if plan.use else 0) + extra
        runner.model_memory_usage += nbytes - self.accounted
        self.accounted = nbytes
        return plan.use

    def close(self) -> None:
        """Release what the capture holds: finish copies in flight, drop staging, unregister the ring."""
        if self.closed:
            return
        self.closed = True
        pending, self.pending = self.pending, None
        copier = self.copier
        ring, self.ring = self.ring, None
        if isinstance(copier, DirectQuantize):
            copier.buffers = None
        try:
            if pending is not None and pending.ready is not None:
                pending.ready.synchronize()  # no copy may land in the slots once they are unregistered
            if isinstance(copier, StagedCopy):
                copier.close()
        finally:
            if ring is not None:
                ring.close()

    def advance(self, runner: Any, step: int, slot: int | None, placement: dict | None = None) -> _Pending | None:
        """Start step ``step``'s capture into ``slot`` (and ``placement``: requests' rows straight to their
        tensors, :class:`~speculators_v016.protocol.RowPlacement`); return the previous step's (still pending)."""
        if self.closed:
            raise RuntimeError(f"step {step}: the capture was closed (speculators_capture_close)")
        if not self.is_output:
            return None
        pending = self.pending
        if pending is not None and slot is not None and pending.capture.slot == slot:
            raise RuntimeError(f"step {step}: slot {slot} still holds step {pending.capture.step}")
        self.pending = self._take(runner, step, slot, placement)
        return pending

    def flush(self) -> StepCapture | None:
        """Return the last pending capture (call when no step is in flight)."""
        if not self.is_output:
            return None
        previous, self.pending = self.pending, None
        return previous.result() if previous is not None else None

    def _aux(self, runner: Any, step: int) -> list:
        """The step's aux states: kept by the runner (the last stage), or by this stage's forward wrapper."""
        if self.stage is not None and self.stage.aux is not None:  # a stage before the last
            return self.stage.aux.take(step)
        state = runner.execute_model_state
        if state is None or state.aux_hidden_states is None:
            raise RuntimeError(
                f"step {step}: the model runner holds no aux hidden states "
                "(execute_model failed for this step, or the capture ran outside execute_model/sample_tokens)"
            )
        return state.aux_hidden_states

    def _take(self, runner: Any, step: int, slot: int | None, placement: dict | None = None) -> _Pending:
        if placement and (self.ring is None or slot is None or self.stage is not None or self.held is not None):
            raise RuntimeError(
                f"step {step}: rows placed in requests' tensors need a ring slot and no pipeline stages "
                f"(slot {slot!r}, ring {self.ring is not None}, stage {self.stage is not None})"
            )
        aux = self._aux(runner, step)
        if len(aux) != self.num_ids:
            raise RuntimeError(f"step {step}: the model returned {len(aux)} aux states, {self.num_ids} were set up")
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        bounds = runner.query_start_loc.np[: num_reqs + 1].tolist()
        total = bounds[-1]
        if aux[0].shape[0] < total:
            raise RuntimeError(f"step {step}: {aux[0].shape[0]} rows of aux states for {total} scheduled tokens")
        capture = StepCapture(
            step=step,
            req_ids=list(batch.req_ids[:num_reqs]),
            starts=batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            counts=[b - a for a, b in zip(bounds, bounds[1:])],
            slot=slot,
            layers=self.rows if self.stage is not None else None,
            stage=self.stage.rank if self.stage is not None else 0,
        )
        if self.held is not None:  # an in-process CPU engine: the states themselves, once proven not reused
            if slot is not None:
                raise RuntimeError(
                    f"step {step}: slot {slot} given, but this worker hands its states over by reference"
                )
            capture.states = [layer[:total] for layer in aux]
            self.held.hand_over(step, capture.states)
            return _Pending(capture, None)
        dst, dst_scales = self._destination(step, slot, total, aux[0])
        if slot is None:
            capture.states, capture.scales = dst, dst_scales
        segments, ranges, placed = split_rows(capture.req_ids, capture.starts, bounds, placement)
        if placement:
            capture.placed = placed
        if self.proofs is not None and slot is not None:  # staged: the sum lands in the slot's proof with the rows
            proof = self.proofs[slot]
            return _Pending(capture, self.copier.copy(aux, total, dst, dst_scales, segments, ranges, proof), proof)
        return _Pending(capture, self.copier.copy(aux, total, dst, dst_scales, segments, ranges))

    def _destination(
        self, step: int, slot: int | None, total: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Host memory for this step, its ring slot or new tensors: states ``[num_ids, total, hidden]``
        (e4m3 codes with FP8 storage) and FP8 scales ``[num_ids, total]`` (else None)."""
        ring = self.ring
        if ring is None:
            if slot is not None:
                raise RuntimeError(f"step {step}: slot {slot} given, but this worker has no ring")
            shape = (self.num_ids, total, like.shape[-1])
            if not self.fp8:
                return torch.empty(shape, dtype=like.dtype, pin_memory=self.pin), None
            return (
                torch.empty(shape, dtype=fp8.CODE_DTYPE, pin_memory=self.pin),
                torch.empty(shape[:2], dtype=fp8.SCALE_DTYPE, pin_memory=self.pin),
            )
        spec = ring.spec
        if slot is None or not 0 <= slot < spec.slots:
            raise RuntimeError(f"step {step}: no valid ring slot given ({slot!r} of {spec.slots})")
        if total > spec.max_rows or like.shape[-1] != spec.hidden or like.dtype != spec.torch_dtype:
            raise RuntimeError(
                f"step {step}: {total} rows of {like.shape[-1]} x {like.dtype} do not fit the ring "
                f"({spec.max_rows} rows of {spec.hidden} x {spec.dtype})"
            )
        scales = ring.scales(slot)
        first, end = self.rows
        return ring.slot(slot)[first:end, :total], (scales[first:end, :total] if scales is not None else None)


def freeze_at_exit_if_apart(setup: WorkerSetup) -> bool:
    """In a worker process of vLLM's (not the one driving the engine: the multiprocess executor's workers, Ray's
    actors), have the objects frozen at exit (:mod:`~speculators_v016.shared.exit_gc`): the executor waits for its
    workers to end at shutdown. Whether it did."""
    if not setup.driver_pid or setup.driver_pid == os.getpid():
        return False
    exit_gc.freeze_at_exit()
    return True


class CaptureWorkerExtension:
    """Mixed into vLLM's worker by ``ParallelConfig.worker_extension_cls``: the RPC entry points, and one
    attribute on vLLM's worker, ``_speculators_capture`` (a :class:`Capture`, None until set up)."""

    _speculators_capture: Capture | None = None
    _speculators_stage: StageShare | None = None  # under pipeline parallelism: this stage's share

    def speculators_capture_setup(self, setup: WorkerSetup) -> dict:
        """Prove the stream, install aux outputs and map the ring; run after model load, before profiling and warm-up."""
        freeze_at_exit_if_apart(setup)
        runner = self.model_runner
        capture = setup.capture
        rope_native = cpu_rope.install(runner.get_model(), runner.device)
        stack = find_decoder_stack(runner.get_model())
        stage = stage_of(stack.decoder, stack.num_layers)
        info = install_aux_outputs(
            runner.get_model(),
            list(capture.capture_ids),
            capture.capture_mode,
            check=engine_check_forward(runner),
            stage=stage,
        )
        info["cpu_rope_native"] = rope_native
        runner.use_aux_hidden_state_outputs = bool(info["stage_ids"])
        if stage.size > 1:
            self._speculators_stage = StageShare.set_up(runner, stage, tuple(info["stage_rows"]), info["stage_ids"])
            info["stage_fix_prompt_rows"] = self._speculators_stage.keeps_prompt_rows
        info["cpu_async_output"] = runner.use_async_scheduling and cpu_async.install(runner.device)
        info["async_scheduling"] = bool(runner.use_async_scheduling)
        attached = self.speculators_capture_attach(setup)
        info["ring"] = setup.ring is not None and attached.is_output
        info["hidden_states_dtype"] = capture.hidden_states_dtype
        info.update(attached.copy_info)
        return info

    def speculators_capture_attach(self, setup: WorkerSetup) -> Capture:
        """Map the ring on the output rank (pinned on GPUs) and choose the copy path, once; no step pending.

        A ring of another ``hidden_states_dtype`` than the capture's is refused.
        Attaching again first releases what the previous attach held.
        """
        previous = self._speculators_capture
        if previous is not None:
            previous.close()
        self._speculators_capture = None
        self._speculators_capture = Capture(self, setup, previous.accounted if previous is not None else 0)
        return self._speculators_capture

    def speculators_capture_close(self) -> None:
        """Release what the capture holds: finish copies in flight, drop staging, unregister the ring."""
        if self._speculators_capture is not None:
            self._speculators_capture.close()

    def speculators_capture_step(
        self, step: int, slot: int | None = None, placement: dict | None = None
    ) -> StepCapture | None:
        """Capture step ``step`` (just executed) into ``slot`` (and ``placement``, in-process engines only);
        return the previous step's capture."""
        pending = self._speculators_capture.advance(self.model_runner, step, slot, placement)
        return pending.result() if pending is not None else None

    def speculators_capture_sample(
        self, step: int, slot: int | None, grammar_output: Any, placement: dict | None = None
    ) -> Any:
        """:meth:`speculators_capture_step`, then vLLM's ``sample_tokens``, in one RPC.

        The reply is ``(model runner output, previous step's capture)``. It is
        built where vLLM builds its own async output (the worker's output
        thread with async scheduling), so this thread never waits for the
        previous step's copy, and each step costs the engine two RPCs, not three.
        """
        pending = self._speculators_capture.advance(self.model_runner, step, slot, placement)
        if self.model_runner.device.type == "cpu":  # seeded requests with chunked prompts (worker.cpu_seeds)
            with discarded_generators_aside(self.model_runner):
                return paired_output(self.sample_tokens(grammar_output), pending)
        return paired_output(self.sample_tokens(grammar_output), pending)

    def speculators_capture_flush(self) -> StepCapture | None:
        """Return the last pending capture (call when no step is in flight)."""
        capture = self._speculators_capture
        return capture.flush() if capture is not None else None
