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
plain copy. The reply is the *previous* step's metadata
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

With FP8 storage (``--hidden-states-dtype fp8_e4m3``) each layer's rows are
quantized here (:mod:`speculators_v016.fp8`: e4m3 codes, one float32 scale
per row) before they leave the device, and the slot holds codes and scales:
``staged``, the quantization is the device-to-device step (into staging
buffers of codes and scales); ``direct``, it writes a device buffer of one
layer on the compute stream, which the device-to-host copy then reads (the
stream orders the next layer's quantization after that copy); on CPU it
writes straight into the slot. Half the bytes cross PCIe, the ring and the
host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from speculators_v016 import fp8
from speculators_v016.protocol import RingSpec, StepCapture
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.worker import cpu_async, cpu_rope
from speculators_v016.worker.aux_outputs import install_aux_outputs
from speculators_v016.worker.check_forward import engine_check_forward
from speculators_v016.worker.staging import Fp8Buffers, StagingCopier, StagingPlan, plan_staging


@dataclass
class _Pending:
    capture: StepCapture
    ready: torch.cuda.Event | None

    def result(self) -> StepCapture:
        if self.ready is not None:
            self.ready.synchronize()
        return self.capture


@functools.cache
def _paired_class() -> type:
    """vLLM's async output type, carrying a step's model output and the previous step's capture."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

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


class CaptureWorkerExtension:
    """Mixed into vLLM's worker by ``ParallelConfig.worker_extension_cls``."""

    def speculators_capture_setup(
        self,
        capture_ids: list[int],
        output_rank: int,
        mode: str = "auto",
        ring: RingSpec | None = None,
        storage: str = "auto",
        staging: str = "auto",
    ) -> dict:
        """Prove the stream, install aux outputs and map the ring; run after model load, before profiling and warm-up.

        ``storage``: "auto" (the engine's dtype) or "fp8_e4m3" (quantized here).
        """
        runner = self.model_runner
        rope_native = cpu_rope.install(runner.get_model(), runner.device)
        info = install_aux_outputs(runner.get_model(), capture_ids, mode, check=engine_check_forward(runner))
        info["cpu_rope_native"] = rope_native
        runner.use_aux_hidden_state_outputs = True
        info["cpu_async_output"] = runner.use_async_scheduling and cpu_async.install(runner.device)
        info["async_scheduling"] = bool(runner.use_async_scheduling)
        self.speculators_capture_attach(len(capture_ids), self.rank == output_rank, ring, staging, storage)
        info["ring"] = ring is not None and self._speculators_is_output
        info["storage"] = storage
        info.update(self._speculators_copy_info)
        return info

    def speculators_capture_attach(
        self, num_ids: int, is_output: bool, ring: RingSpec | None, staging: str = "auto", storage: str | None = None
    ) -> None:
        """Map the ring on the output rank (pinned on GPUs) and choose the copy path; reset the pending capture.

        ``staging``: ``"auto"`` stages on the GPU when :func:`plan_staging`
        says it fits, ``"off"`` keeps the direct path. ``storage`` ("auto" or
        "fp8_e4m3") defaults to the ring's; a ring of another storage is
        refused. Attaching again first releases what the previous attach held.
        """
        if staging not in ("auto", "off"):
            raise ValueError(f"staging {staging!r}: choose 'auto' or 'off'")
        storage = storage or (ring.storage if ring is not None else "auto")
        if storage not in ("auto", fp8.NAME):
            raise ValueError(f"hidden-states storage {storage!r}: expected 'auto' or {fp8.NAME!r}")
        if ring is not None and ring.storage != storage:
            raise RuntimeError(f"the capture ring stores {ring.storage!r}, the capture was set up for {storage!r}")
        if getattr(self, "_speculators_attached", False):
            self.speculators_capture_close()
        self._speculators_is_output = is_output
        self._speculators_num_ids = num_ids
        self._speculators_fp8 = storage == fp8.NAME
        self._speculators_quant: Fp8Buffers | None = None  # FP8, direct path: one layer's codes and scales
        self._speculators_pending: _Pending | None = None
        self._speculators_ring = None
        self._speculators_staging: StagingCopier | None = None
        self._speculators_attached, self._speculators_closed = True, False
        device = self.model_runner.device
        path = "none" if not is_output else "direct" if device.type == "cuda" else "host"
        self._speculators_copy_info = {"copy_path": path}
        if not (is_output and ring is not None):
            return
        self._speculators_ring = SlotRing.attach(ring)
        if device.type != "cuda":
            return
        self._speculators_ring.pin()
        plan = self._speculators_plan_staging(ring, device, staging)
        if plan.use:
            try:
                self._speculators_staging = StagingCopier(
                    plan,
                    (ring.num_ids, ring.max_rows, ring.hidden),
                    ring.torch_dtype,
                    device,
                    fp8=self._speculators_fp8,
                )
            except torch.cuda.OutOfMemoryError as exc:
                plan = StagingPlan(
                    False,
                    plan.buffers,
                    plan.buffer_bytes,
                    f"staging buffers could not be allocated ({exc}): direct copies",
                )
        quant_bytes = 0
        if self._speculators_fp8 and not plan.use:  # allocated now, before vLLM profiles memory
            self._speculators_quant = Fp8Buffers(
                torch.empty((1, ring.max_rows, ring.hidden), dtype=fp8.CODE_DTYPE, device=device),
                torch.empty((1, ring.max_rows), dtype=fp8.SCALE_DTYPE, device=device),
            )
            quant_bytes = ring.max_rows * (ring.hidden + 4)
        self._speculators_copy_info = {
            "copy_path": "staged" if plan.use else "direct",
            "staging": plan.describe(),
            "staging_in_model_memory": self._speculators_account(plan, quant_bytes),
        }

    def _speculators_plan_staging(self, ring: RingSpec, device: torch.device, staging: str) -> StagingPlan:
        """One staging buffer per step in flight (the ring has one slot more), if it fits (see plan_staging)."""
        buffers = max(ring.slots - 1, 1)
        if staging == "off":
            return StagingPlan(False, buffers, ring.slot_bytes, "staging turned off: direct copies")
        free, total = torch.cuda.mem_get_info(device)
        requested, init = getattr(self, "requested_memory", None), getattr(self, "init_snapshot", None)
        budget_left = None
        if requested is not None and init is not None:
            # vLLM's budget (total x gpu_memory_utilization) minus what this instance took since its
            # start-up snapshot (weights, NCCL, ...): what the activations and the KV cache will share.
            budget_left = int(requested) - ((total - free) - int(init.cuda_memory))
        return plan_staging(buffers, ring.slot_bytes, free, budget_left)

    def _speculators_account(self, plan: StagingPlan, extra: int = 0) -> bool:
        """Count the staging bytes (and ``extra``: FP8's one-layer buffer of the direct path) as model
        memory, which vLLM subtracts before it sizes the KV cache."""
        runner = self.model_runner
        if not hasattr(runner, "model_memory_usage"):
            return False
        nbytes = (plan.nbytes if plan.use else 0) + extra
        runner.model_memory_usage += nbytes - getattr(self, "_speculators_accounted", 0)
        self._speculators_accounted = nbytes
        return plan.use

    def speculators_capture_close(self) -> None:
        """Release what the capture holds: finish copies in flight, drop staging, unregister the ring."""
        if not getattr(self, "_speculators_attached", False):
            return
        self._speculators_attached, self._speculators_closed = False, True
        pending, self._speculators_pending = self._speculators_pending, None
        staging, self._speculators_staging = self._speculators_staging, None
        ring, self._speculators_ring = self._speculators_ring, None
        self._speculators_quant = None
        try:
            if pending is not None and pending.ready is not None:
                pending.ready.synchronize()  # no copy may land in the slots once they are unregistered
            if staging is not None:
                staging.close()
        finally:
            if ring is not None:
                ring.close()

    def speculators_capture_step(self, step: int, slot: int | None = None) -> StepCapture | None:
        """Capture step ``step`` (just executed) into ``slot``; return the previous step's capture."""
        pending = self._speculators_advance(step, slot)
        return pending.result() if pending is not None else None

    def speculators_capture_sample(self, step: int, slot: int | None, grammar_output: Any) -> Any:
        """:meth:`speculators_capture_step`, then vLLM's ``sample_tokens``, in one RPC.

        The reply is ``(model runner output, previous step's capture)``. It is
        built where vLLM builds its own async output (the worker's output
        thread with async scheduling), so this thread never waits for the
        previous step's copy, and each step costs the engine two RPCs, not three.
        """
        pending = self._speculators_advance(step, slot)
        return paired_output(self.sample_tokens(grammar_output), pending)

    def _speculators_advance(self, step: int, slot: int | None) -> _Pending | None:
        """Start step ``step``'s capture into ``slot``; return the previous step's (still pending)."""
        if getattr(self, "_speculators_closed", False):
            raise RuntimeError(f"step {step}: the capture was closed (speculators_capture_close)")
        if not self._speculators_is_output:
            return None
        pending = self._speculators_pending
        if pending is not None and slot is not None and pending.capture.slot == slot:
            raise RuntimeError(f"step {step}: slot {slot} still holds step {pending.capture.step}")
        self._speculators_pending = self._speculators_take(step, slot)
        return pending

    def speculators_capture_flush(self) -> StepCapture | None:
        """Return the last pending capture (call when no step is in flight)."""
        if not getattr(self, "_speculators_is_output", False):
            return None
        previous, self._speculators_pending = self._speculators_pending, None
        return previous.result() if previous is not None else None

    def _speculators_take(self, step: int, slot: int | None) -> _Pending:
        runner = self.model_runner
        state = runner.execute_model_state
        if state is None or state.aux_hidden_states is None:
            raise RuntimeError(
                f"step {step}: the model runner holds no aux hidden states "
                "(capture called outside execute_model/sample_tokens?)"
            )
        aux = state.aux_hidden_states
        if len(aux) != self._speculators_num_ids:
            raise RuntimeError(
                f"step {step}: the model returned {len(aux)} aux states, {self._speculators_num_ids} were set up"
            )
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        bounds = runner.query_start_loc.np[: num_reqs + 1].tolist()
        total = bounds[-1]
        capture = StepCapture(
            step=step,
            req_ids=list(batch.req_ids[:num_reqs]),
            starts=batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            counts=[b - a for a, b in zip(bounds, bounds[1:])],
            slot=slot,
        )
        on_gpu = aux[0].device.type == "cuda"
        dst, dst_scales = self._speculators_destination(step, slot, total, aux[0], on_gpu)
        if slot is None:
            capture.states, capture.scales = dst, dst_scales
        staging = self._speculators_staging
        if staging is not None and slot is not None:
            target = Fp8Buffers(dst, dst_scales) if self._speculators_fp8 else dst
            return _Pending(capture, staging.copy(aux, total, target))  # event on the copy stream
        if not self._speculators_fp8:
            for j, layer in enumerate(aux):  # one contiguous copy per layer, no intermediate buffer
                dst[j].copy_(layer[:total], non_blocking=on_gpu)
        elif not on_gpu:
            for j, layer in enumerate(aux):  # quantized straight into the slot
                fp8.quantize_into(layer[:total], dst[j], dst_scales[j])
        else:
            codes, scales = self._speculators_quant_buffer(total, aux[0].shape[-1], aux[0].device)
            for j, layer in enumerate(aux):  # compute stream: quantize, then copy codes and scales to the host
                fp8.quantize_into(layer[:total], codes, scales)
                dst[j].copy_(codes, non_blocking=True)
                dst_scales[j].copy_(scales, non_blocking=True)
        if not on_gpu:
            return _Pending(capture, None)
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: the copy is ordered before the next forward
        return _Pending(capture, ready)

    def _speculators_quant_buffer(
        self, rows: int, hidden: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8, direct path: device codes ``[rows, hidden]`` and scales ``[rows]`` of one layer (kept)."""
        have = self._speculators_quant
        if have is None or have.codes.shape[1] < rows or have.codes.shape[2] != hidden:  # no ring: grow
            have = self._speculators_quant = Fp8Buffers(
                torch.empty((1, rows, hidden), dtype=fp8.CODE_DTYPE, device=device),
                torch.empty((1, rows), dtype=fp8.SCALE_DTYPE, device=device),
            )
        return have.codes[0, :rows], have.scales[0, :rows]

    def _speculators_destination(
        self, step: int, slot: int | None, total: int, like: torch.Tensor, on_gpu: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Host memory for this step, its ring slot or new tensors: states ``[num_ids, total, hidden]``
        (e4m3 codes with FP8 storage) and FP8 scales ``[num_ids, total]`` (else None)."""
        ring = self._speculators_ring
        if ring is None:
            if slot is not None:
                raise RuntimeError(f"step {step}: slot {slot} given, but this worker has no ring")
            shape = (self._speculators_num_ids, total, like.shape[-1])
            if not self._speculators_fp8:
                return torch.empty(shape, dtype=like.dtype, pin_memory=on_gpu), None
            return (
                torch.empty(shape, dtype=fp8.CODE_DTYPE, pin_memory=on_gpu),
                torch.empty(shape[:2], dtype=fp8.SCALE_DTYPE, pin_memory=on_gpu),
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
        return ring.slot(slot)[:, :total], (scales[:, :total] if scales is not None else None)
