"""GPU staging of captured states: the step's rows leave the compute stream as a device-to-device copy.

A device-to-host copy on the compute stream holds the next forward back
until the step's bytes have crossed PCIe (448 MiB a step is ~9 ms at
50 GiB/s). :class:`StagingCopier` instead copies the step's rows into a
staging buffer on the device (on the compute stream, ordered after the
forward and before the next one overwrites any buffer: ~0.25 ms for
448 MiB), records an event, and a dedicated copy stream waits on that event
and moves the staging buffer into the step's host slot while the next
forward runs. There is one staging buffer per step in flight; the compute
stream waits, on the device, for a buffer's previous device-to-host copy
before it writes that buffer again.

Each step, in stream order::

    compute stream:  forward k | wait drained[i] | fill staging[i] | record staged | forward k+1 ...
    copy stream:                                   wait staged | staging[i] -> slot | record drained[i]

:meth:`StagingCopier.fill` (the device-to-device step) is the seam where a
transform of the rows belongs: with FP8 storage it quantizes them
(:mod:`speculators_v016.fp8`) into staging buffers of e4m3 codes and float32
scales (:class:`Fp8Buffers`), so the quantization is the device-to-device
step and only codes and scales cross PCIe; :meth:`StagingCopier.drain`
moves a staged buffer to the host.

The NaN/Inf proof: with ``proof`` (a pinned host float32 scalar),
:meth:`StagingCopier.copy` also sums the staged rows in float32 on the
device, after the fill, and copies the sum to ``proof`` with the rows. IEEE
arithmetic makes the sum NaN or infinite whenever any value is (NaN absorbs
everything; an infinity stays one or, met by its opposite, becomes NaN), so
a finite sum proves every value of the step's rows finite and the writers
need not read the bytes to test them (``StepCapture.finite``). The converse
does not hold: finite values whose sum overflows float32 leave the step
unproven, and the writers test its bytes, as they test every step of a CPU
engine and the direct path. On CUDA with Triton the fill and the sum are one
pass (:mod:`~speculators_v016.worker.staged_sum`: each row read once,
copied and summed); elsewhere the sum reads the staging buffer once more on
the device (~0.15 ms for 448 MiB on an H100; a step of that size runs
~50 ms). With FP8 storage the sum is of the step's scales (4 bytes a row):
a row holding NaN or Inf gets a NaN or Inf scale (:mod:`speculators_v016.fp8`),
and a finite row divided by its finite scale is at most 448 in magnitude,
so its codes are finite e4m3 values; a finite sum of the (positive) scales
thus proves the codes and the scales finite.

Memory: the buffers are allocated at capture set-up, after vLLM loaded the
model and before it profiles memory and sizes the KV cache, and the worker
adds their bytes to the runner's ``model_memory_usage`` (what vLLM 0.16
subtracts from ``gpu_memory_utilization``'s budget, with the activation
peak, before it gives the rest to the KV cache). So staging lives inside
the budget, like the weights, and the KV cache is that much smaller.
:func:`plan_staging` decides at set-up whether staging is used: it must fit
in the device's free memory and take at most :data:`MAX_BUDGET_SHARE` of the
budget vLLM still has to give out (activations and KV cache); otherwise the
capture keeps the direct path (device-to-host on the compute stream) and
says why in its set-up info.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from speculators_v016 import fp8
from speculators_v016.worker.row_placement import destinations

#: Staging takes at most this share of what vLLM has left for activations and the KV cache.
MAX_BUDGET_SHARE = 0.25
#: Device memory left free after the staging buffers (allocator slack, the profile run's first blocks).
FREE_HEADROOM_BYTES = 512 * 2**20
#: Partial float32 sums a buffer's one-pass fill and proof adds its rows into (spread over addresses), before
#: their total: each buffer has its own, so a step's partials are ordered after that buffer's last drain, as its
#: rows are, whatever stream a step runs on.
PROOF_PARTIALS = 32


@dataclass(frozen=True)
class StagingPlan:
    """Whether the capture stages on the device, and why."""

    use: bool
    buffers: int
    buffer_bytes: int
    reason: str

    @property
    def nbytes(self) -> int:
        return self.buffers * self.buffer_bytes

    def describe(self) -> dict:
        return {"staged": self.use, "buffers": self.buffers, "bytes": self.nbytes, "reason": self.reason}


def plan_staging(
    buffers: int, buffer_bytes: int, free_bytes: int, budget_left: int | None, share: float = MAX_BUDGET_SHARE
) -> StagingPlan:
    """Stage if ``buffers x buffer_bytes`` fits the free memory and ``share`` of the budget left.

    ``budget_left``: bytes of ``gpu_memory_utilization``'s budget not yet
    used by this vLLM instance (None when the worker does not say; then only
    the free memory decides).
    """
    if buffers < 1:
        raise ValueError(f"staging needs at least one buffer, got {buffers}")
    need = buffers * buffer_bytes
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    if budget_left is not None and need > share * budget_left:
        return StagingPlan(
            False,
            buffers,
            buffer_bytes,
            f"{buffers} staging buffers need {mib(need)}, more than {share:.0%} of the "
            f"{mib(max(budget_left, 0))} gpu_memory_utilization leaves for activations and "
            "KV cache: device-to-host copies stay on the compute stream",
        )
    if need > free_bytes - FREE_HEADROOM_BYTES:
        return StagingPlan(
            False,
            buffers,
            buffer_bytes,
            f"{buffers} staging buffers need {mib(need)}, the device has {mib(free_bytes)} "
            "free: device-to-host copies stay on the compute stream",
        )
    where = "inside gpu_memory_utilization" if budget_left is not None else "budget unknown"
    return StagingPlan(
        True,
        buffers,
        buffer_bytes,
        f"{buffers} x {mib(buffer_bytes)} staged on the device ({where}); device-to-host copies on a copy stream",
    )


class Fp8Buffers(NamedTuple):
    """FP8 rows of a step: codes ``[num_ids, rows, hidden]`` e4m3 and scales ``[num_ids, rows]`` float32."""

    codes: torch.Tensor
    scales: torch.Tensor


class CudaStreams:
    """The CUDA calls :class:`StagingCopier` makes (a fake stands in for CPU unit tests)."""

    def __init__(self, device: torch.device):
        self.device = device

    def compute(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> AbstractContextManager:
        return torch.cuda.stream(stream)


class StagingCopier:
    """Staging buffers ``[num_ids, max_rows, hidden]`` on the device, a copy stream and the events between.

    With ``fp8`` each buffer is an :class:`Fp8Buffers` (codes and scales) and
    ``dtype`` is ignored; the destination of :meth:`copy` is then one too.
    """

    def __init__(
        self,
        plan: StagingPlan,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        streams: CudaStreams | None = None,
        fp8: bool = False,
    ):
        if not plan.use:
            raise ValueError(f"staging was not planned: {plan.reason}")
        self.plan = plan
        self.streams = streams or CudaStreams(device)
        self.fp8 = fp8
        self.buffers = [self._buffer(shape, dtype, device) for _ in range(plan.buffers)]
        self.copy_stream = self.streams.new_stream()
        #: each buffer's float32 sum (FP8: of its scales), the NaN/Inf proof; then each buffer's partial sums
        sums = torch.zeros(plan.buffers * (1 + PROOF_PARTIALS), dtype=torch.float32, device=device)
        self.sums = sums[: plan.buffers]
        self.partials = sums[plan.buffers :].view(plan.buffers, PROOF_PARTIALS)
        self._one_pass = False
        #: how the staged rows are filled and proven (set-up info: ``copy_info["staging_fill"]``)
        self.fill_path = self._start_one_pass(device)
        self._drained: list[Any] = [None] * plan.buffers  # event after each buffer's last device-to-host copy
        self._next = 0

    def _buffer(self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device):
        if not self.fp8:
            return torch.empty(shape, dtype=dtype, device=device)
        return Fp8Buffers(
            torch.empty(shape, dtype=fp8.CODE_DTYPE, device=device),
            torch.empty(shape[:2], dtype=fp8.SCALE_DTYPE, device=device),
        )

    def copy(
        self,
        aux: Sequence[torch.Tensor],
        total: int,
        dst: torch.Tensor | Fp8Buffers,
        proof: torch.Tensor | None = None,
        segments=(),
        ranges=None,
    ) -> Any:
        """Stage ``aux[j][:total]`` (compute stream) and drain it into ``dst[j]`` (copy stream).

        Returns the event recorded on the copy stream after the last
        device-to-host copy: once it has completed, ``dst`` holds the rows
        and ``proof`` (a host float32 scalar, if given) their float32 sum
        (FP8: of their scales), finite only if every value is.
        Call from the thread that runs the forward, right after it (the
        compute stream is that thread's current stream).
        """
        index, self._next = self._next, (self._next + 1) % len(self.buffers)
        stage = self.buffers[index]
        compute = self.streams.compute()
        if self._drained[index] is not None:
            compute.wait_event(self._drained[index])  # on the device: the buffer's previous copy-out is done
        if proof is None or not self.fill_and_prove(index, aux, total):
            self.fill(stage, aux, total)
            if proof is not None:  # on the compute stream, after the fill: what the slot will hold
                self.prove(stage, total, self.sums[index])
        staged = self.streams.new_event()
        staged.record(compute)
        self.copy_stream.wait_event(staged)
        with self.streams.use(self.copy_stream):
            self.drain(stage, total, dst, segments, ranges)
            if proof is not None:
                proof.copy_(self.sums[index], non_blocking=True)
        drained = self.streams.new_event()
        drained.record(self.copy_stream)
        self._drained[index] = drained
        return drained

    def fill(self, stage: torch.Tensor | Fp8Buffers, aux: Sequence[torch.Tensor], total: int) -> None:
        """Device-to-device, on the current (compute) stream: the step's rows into ``stage`` (FP8: quantized)."""
        for j, layer in enumerate(aux):
            if isinstance(stage, Fp8Buffers):
                fp8.quantize_into(layer[:total], stage.codes[j, :total], stage.scales[j, :total])
            else:
                stage[j, :total].copy_(layer[:total])

    def _start_one_pass(self, device: torch.device) -> str:
        """Whether :meth:`fill_and_prove` is used, its kernel compiled now (at the engine's start, not in a run's
        first step) on one row of buffer 0; any failure leaves the two passes, and the reason says so."""
        if self.fp8:
            return "FP8: quantized on the device, its scales summed"
        if device.type != "cuda":
            return f"copy, then sum (a {device.type} device)"
        if _one_pass_kernel() is None:
            return "copy, then sum (Triton is not installed)"
        self._one_pass = True
        try:
            taken = self.fill_and_prove(0, [torch.zeros_like(self.buffers[0][0, :1])], 1)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here: the torch passes, said why
            taken, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = "the kernel does not take the staging buffers' layout"
        if not taken:
            self._one_pass = False
            return f"copy, then sum (the one-pass kernel failed at set-up: {why})"
        return "copy and sum in one pass (Triton)"

    def fill_and_prove(self, index: int, aux: Sequence[torch.Tensor], total: int) -> bool:
        """:meth:`fill` and :meth:`prove` of buffer ``index`` in one pass over the rows (CUDA, Triton, rows not
        FP8), its proof into ``sums[index]``; False, having done nothing, where the kernel does not apply (then
        the two passes)."""
        kernel = _one_pass_kernel() if self._one_pass else None
        stage, partials = self.buffers[index], self.partials[index]
        if kernel is None or isinstance(stage, Fp8Buffers):
            return False
        if not all(kernel.usable(layer[:total], stage[j, :total], partials) for j, layer in enumerate(aux)):
            return False
        partials.zero_()
        for j, layer in enumerate(aux):
            kernel.copy_and_add(layer[:total], stage[j, :total], partials)
        torch.sum(partials, dim=0, out=self.sums[index])
        return True

    @staticmethod
    def prove(stage: torch.Tensor | Fp8Buffers, total: int, out: torch.Tensor) -> None:
        """The step's float32 sum into ``out`` (a device scalar): of its rows, or with FP8 of its scales."""
        if isinstance(stage, Fp8Buffers):
            torch.sum(stage.scales[:, :total], dim=(0, 1), dtype=torch.float32, out=out)
        else:
            torch.sum(stage[:, :total], dim=(0, 1, 2), dtype=torch.float32, out=out)

    def drain(
        self, stage: torch.Tensor | Fp8Buffers, total: int, dst: torch.Tensor | Fp8Buffers, segments=(), ranges=None
    ) -> None:
        """Device-to-host, on the copy stream: one contiguous copy per layer and range into the pinned slot
        (``ranges``: its rows ``[a, b)``; None: all), and per placed request into its pinned tensors
        (``segments``, :func:`~speculators_v016.worker.row_placement.split_rows`)."""
        ranges = [(0, total)] if ranges is None else ranges
        fp8_stage = isinstance(stage, Fp8Buffers)
        codes = stage.codes if fp8_stage else stage
        for j in range(codes.shape[0]):
            for a, b in ranges:
                (dst.codes if fp8_stage else dst)[j, a:b].copy_(codes[j, a:b], non_blocking=True)
                if fp8_stage:
                    dst.scales[j, a:b].copy_(stage.scales[j, a:b], non_blocking=True)
            for first, count, to, to_scales in destinations(segments, j):
                to.copy_(codes[j, first : first + count], non_blocking=True)
                if fp8_stage:
                    to_scales.copy_(stage.scales[j, first : first + count], non_blocking=True)

    def close(self) -> None:
        """Wait for the copies in flight, then let the buffers and the proof's sums go."""
        for event in self._drained:
            if event is not None:
                event.synchronize()
        self._drained = [None] * len(self.buffers)
        self.buffers = []
        self.sums = self.sums.new_empty(0)  # the NaN/Inf proof's sums go with the buffers (no device memory)
        self.partials = self.sums


def _one_pass_kernel() -> Any:
    """:mod:`~speculators_v016.worker.staged_sum` where Triton is installed (vLLM's GPU installs), else None."""
    try:
        from speculators_v016.worker import staged_sum  # noqa: PLC0415 - Triton, CUDA only
    except ImportError:
        return None
    return staged_sum
