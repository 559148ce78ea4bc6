"""Worker side of the capture: set up aux outputs, and hand each step's states over.

vLLM mixes :class:`CaptureWorkerExtension` into its worker class
(``worker_extension_cls``), so these methods run in every worker process and
are reached with ``collective_rpc``. Method names carry a ``speculators_``
prefix: an extension may not redefine a worker method.

Between ``execute_model`` and ``sample_tokens`` of step ``k`` the engine calls
:meth:`~CaptureWorkerExtension.speculators_capture_step`. On the output rank
it stacks the step's aux states (only the scheduled tokens, no padding),
starts their copy to host memory, and returns the *previous* step's capture,
whose copy has long finished: on GPUs the host thread never waits for the
step that is still running, and with async scheduling the next step's input
preparation overlaps the forward pass as vLLM intends. The copy is enqueued
on the compute stream, so it is ordered before the next forward overwrites
any buffer (CUDA graphs reuse theirs). Other ranks return nothing: the states
cross a process boundary once, from the output rank to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculators_v016 import cpu_async
from speculators_v016.aux_outputs import install_aux_outputs


@dataclass
class StepCapture:
    """The aux states of one step, in the runner's batch order."""

    step: int
    req_ids: list[str]
    starts: list[int]  # position in the prompt of each request's first row
    counts: list[int]  # rows per request
    states: torch.Tensor  # [sum(counts), num_capture_ids, hidden], on the host


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

    def speculators_capture_setup(self, capture_ids: list[int], output_rank: int, mode: str = "auto") -> dict:
        """Install aux outputs; run after model load, before profiling and warm-up."""
        runner = self.model_runner
        info = install_aux_outputs(runner.get_model(), capture_ids, mode)
        runner.use_aux_hidden_state_outputs = True
        info["cpu_async_output"] = runner.use_async_scheduling and cpu_async.install(runner.device)
        info["async_scheduling"] = bool(runner.use_async_scheduling)
        self._speculators_is_output = self.rank == output_rank
        self._speculators_num_ids = len(capture_ids)
        self._speculators_pending: _Pending | None = None
        return info

    def speculators_capture_step(self, step: int) -> StepCapture | None:
        """Capture step ``step`` (just executed); return the previous step's capture."""
        if not self._speculators_is_output:
            return None
        previous, self._speculators_pending = self._speculators_pending, self._speculators_take(step)
        return previous.result() if previous is not None else None

    def speculators_capture_flush(self) -> StepCapture | None:
        """Return the last pending capture (call when no step is in flight)."""
        if not getattr(self, "_speculators_is_output", False):
            return None
        previous, self._speculators_pending = self._speculators_pending, None
        return previous.result() if previous is not None else None

    def _speculators_take(self, step: int) -> _Pending:
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
        stacked = torch.stack([a[:total] for a in aux], dim=1)  # a new tensor: safe from buffer reuse
        capture = StepCapture(
            step=step,
            req_ids=list(batch.req_ids[:num_reqs]),
            starts=batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            counts=[b - a for a, b in zip(bounds, bounds[1:])],
            states=stacked,
        )
        if stacked.device.type != "cuda":
            return _Pending(capture, None)
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)  # on the compute stream: ordered before the next forward
        ready = torch.cuda.Event()
        ready.record()
        capture.states = host
        return _Pending(capture, ready)
