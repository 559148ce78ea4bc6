"""Worker side of the capture: set up aux outputs, and hand each step's states over.

vLLM mixes :class:`CaptureWorkerExtension` into its worker class
(``worker_extension_cls``), so these methods run in every worker process and
are reached with ``collective_rpc``. Method names carry a ``speculators_``
prefix: an extension may not redefine a worker method.

Between ``execute_model`` and ``sample_tokens`` of step ``k`` the engine calls
:meth:`~CaptureWorkerExtension.speculators_capture_step` with the ring slot it
gave that step. On the output rank the step's aux states (only the scheduled
tokens, no padding) are copied into the slot, one contiguous copy per layer:
on GPUs a device-to-host copy straight into the slot (registered once as
pinned memory), enqueued on the compute stream, so it is ordered after the
step's forward and before the next forward overwrites any buffer (CUDA graphs
reuse theirs); on CPU a plain copy. The reply is the *previous* step's
metadata (:class:`StepCapture`: slot, request ids, starts, counts), whose copy
has long finished: the host thread never waits for the step still running,
and no state crosses the process boundary by pickling. Other ranks return
nothing. Without a ring (the Ray executor, whose workers may sit on other
hosts) the states travel in the reply, as a host tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculators_v016.worker import cpu_async, cpu_rope
from speculators_v016.worker.aux_outputs import install_aux_outputs
from speculators_v016.engine.slot_ring import SlotRing
from speculators_v016.protocol import RingSpec, StepCapture


@dataclass
class _Pending:
    capture: StepCapture
    ready: torch.cuda.Event | None

    def result(self) -> StepCapture:
        if self.ready is not None:
            self.ready.synchronize()
        return self.capture


class CaptureWorkerExtension:
    """Mixed into vLLM's worker by ``ParallelConfig.worker_extension_cls``."""

    def speculators_capture_setup(self, capture_ids: list[int], output_rank: int, mode: str = "auto",
                                  ring: RingSpec | None = None) -> dict:
        """Install aux outputs and map the ring; run after model load, before profiling and warm-up."""
        runner = self.model_runner
        info = install_aux_outputs(runner.get_model(), capture_ids, mode)
        info["cpu_rope_native"] = cpu_rope.install(runner.get_model(), runner.device)
        runner.use_aux_hidden_state_outputs = True
        info["cpu_async_output"] = runner.use_async_scheduling and cpu_async.install(runner.device)
        info["async_scheduling"] = bool(runner.use_async_scheduling)
        self.speculators_capture_attach(len(capture_ids), self.rank == output_rank, ring)
        info["ring"] = ring is not None and self._speculators_is_output
        return info

    def speculators_capture_attach(self, num_ids: int, is_output: bool, ring: RingSpec | None) -> None:
        """Map the ring on the output rank (pinned on GPUs); reset the pending capture."""
        self._speculators_is_output = is_output
        self._speculators_num_ids = num_ids
        self._speculators_pending: _Pending | None = None
        self._speculators_ring = None
        if is_output and ring is not None:
            self._speculators_ring = SlotRing.attach(ring)
            if self.model_runner.device.type == "cuda":
                self._speculators_ring.pin()

    def speculators_capture_step(self, step: int, slot: int | None = None) -> StepCapture | None:
        """Capture step ``step`` (just executed) into ``slot``; return the previous step's capture."""
        if not self._speculators_is_output:
            return None
        pending = self._speculators_pending
        if pending is not None and slot is not None and pending.capture.slot == slot:
            raise RuntimeError(f"step {step}: slot {slot} still holds step {pending.capture.step}")
        self._speculators_pending = self._speculators_take(step, slot)
        return pending.result() if pending is not None else None

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
            raise RuntimeError(f"step {step}: the model runner holds no aux hidden states "
                               "(capture called outside execute_model/sample_tokens?)")
        aux = state.aux_hidden_states
        if len(aux) != self._speculators_num_ids:
            raise RuntimeError(f"step {step}: the model returned {len(aux)} aux states, "
                               f"{self._speculators_num_ids} were set up")
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
        dst = self._speculators_destination(step, slot, total, aux[0], on_gpu)
        for j, layer in enumerate(aux):  # one contiguous copy per layer, no intermediate buffer
            dst[j].copy_(layer[:total], non_blocking=on_gpu)
        if slot is None:
            capture.states = dst
        if not on_gpu:
            return _Pending(capture, None)
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: the copy is ordered before the next forward
        return _Pending(capture, ready)

    def _speculators_destination(self, step: int, slot: int | None, total: int, like: torch.Tensor,
                                 on_gpu: bool) -> torch.Tensor:
        """``[num_ids, total, hidden]`` host memory for this step: its ring slot, or a new tensor."""
        ring = self._speculators_ring
        if ring is None:
            if slot is not None:
                raise RuntimeError(f"step {step}: slot {slot} given, but this worker has no ring")
            shape = (self._speculators_num_ids, total, like.shape[-1])
            return torch.empty(shape, dtype=like.dtype, pin_memory=on_gpu)
        spec = ring.spec
        if slot is None or not 0 <= slot < spec.slots:
            raise RuntimeError(f"step {step}: no valid ring slot given ({slot!r} of {spec.slots})")
        if total > spec.max_rows or like.shape[-1] != spec.hidden or like.dtype != spec.torch_dtype:
            raise RuntimeError(
                f"step {step}: {total} rows of {like.shape[-1]} x {like.dtype} do not fit the ring "
                f"({spec.max_rows} rows of {spec.hidden} x {spec.dtype})")
        return ring.slot(slot)[:, :total]
