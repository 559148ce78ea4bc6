"""GPU staging bookkeeping, on CPU: the fit decision and the order of copies, events and waits.

A fake stands in for CUDA streams and events (it logs what is recorded and
waited for, in order); the copies are real tensor copies on CPU. The GPU
tier (tests/gpu) runs the same class on a device, at the real cadence.
"""

from __future__ import annotations

import pytest
import torch

from speculators_v016 import fp8
from speculators_v016.worker.staging import FREE_HEADROOM_BYTES, Fp8Buffers, StagingCopier, StagingPlan, plan_staging

MIB = 2**20


class FakeEvent:
    count = 0

    def __init__(self, log):
        FakeEvent.count += 1
        self.name, self.log, self.recorded_on, self.synchronized = f"e{FakeEvent.count}", log, None, False

    def record(self, stream):
        self.recorded_on = stream.name
        self.log.append(("record", stream.name, self.name))

    def synchronize(self):
        self.synchronized = True


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))


class FakeStreams:
    """Logs stream and event calls; ``current`` is the stream copies are issued on."""

    def __init__(self):
        self.log: list[tuple] = []
        self.compute_stream = FakeStream("compute", self.log)
        self.current = "compute"

    def compute(self):
        return self.compute_stream

    def new_stream(self):
        return FakeStream("copy", self.log)

    def new_event(self):
        return FakeEvent(self.log)

    def use(self, stream):
        streams = self

        class _On:
            def __enter__(self):
                streams.current = stream.name

            def __exit__(self, *exc):
                streams.current = "compute"

        return _On()


def _index(buffers, stage):
    return next(i for i, b in enumerate(buffers) if b is stage)


class LoggingCopier(StagingCopier):
    """Records on which (fake) stream each fill and drain is issued, and which buffer it uses."""

    def fill(self, stage, aux, total):
        self.streams.log.append(("fill", self.streams.current, _index(self.buffers, stage)))
        super().fill(stage, aux, total)

    def drain(self, stage, total, dst, *placed):
        self.streams.log.append(("drain", self.streams.current, _index(self.buffers, stage)))
        super().drain(stage, total, dst, *placed)


class NoReuseWaitCopier(LoggingCopier):
    """A broken copier: it overwrites a staging buffer without waiting for its previous copy-out."""

    def copy(self, aux, total, dst):
        self._drained = [None] * len(self.buffers)
        return super().copy(aux, total, dst)


def check_order(log: list[tuple], buffers: int) -> None:
    """Each step: compute waits for the buffer's last drain, fills it, records; copy waits, drains, records."""
    drained_by_buffer: dict[int, str] = {}
    i, step = 0, 0
    while i < len(log):
        buffer = step % buffers
        if buffer in drained_by_buffer:
            assert log[i] == ("wait", "compute", drained_by_buffer[buffer]), (step, log[i])
            i += 1
        fill, staged, wait, drain, drained = log[i : i + 5]
        assert fill == ("fill", "compute", buffer), (step, fill)
        assert staged[:2] == ("record", "compute"), (step, staged)
        assert wait == ("wait", "copy", staged[2]), (step, wait)
        assert drain == ("drain", "copy", buffer), (step, drain)
        assert drained[:2] == ("record", "copy"), (step, drained)
        drained_by_buffer[buffer] = drained[2]
        i, step = i + 5, step + 1


def run_copier(cls, buffers: int, steps: list[int]):
    streams = FakeStreams()
    plan = StagingPlan(True, buffers, 0, "test")
    copier = cls(plan, (3, 16, 8), torch.float32, torch.device("cpu"), streams=streams)
    gen = torch.Generator().manual_seed(0)
    results = []
    for total in steps:
        aux = [torch.randn(16, 8, generator=gen) for _ in range(3)]
        dst = torch.full((3, total, 8), float("nan"))
        event = copier.copy(aux, total, dst)
        results.append((aux, total, dst, event))
    return copier, streams, results


def test_plan_stages_when_it_fits_the_budget_and_the_free_memory():
    """Two 448 MiB buffers fit a 60 GiB budget and 100 GiB free: staged, reason says where."""
    plan = plan_staging(2, 448 * MIB, 100 * 2**30, 60 * 2**30)
    assert plan.use and plan.nbytes == 896 * MIB
    assert plan.describe() == {"staged": True, "buffers": 2, "bytes": 896 * MIB, "reason": plan.reason}
    assert "inside gpu_memory_utilization" in plan.reason


def test_plan_falls_back_when_staging_takes_too_much_of_the_budget():
    """More than a quarter of what vLLM has left for activations and KV cache: direct copies, reason given."""
    plan = plan_staging(2, 448 * MIB, 100 * 2**30, 3 * 2**30)
    assert not plan.use
    assert "896 MiB, more than 25% of the 3,072 MiB gpu_memory_utilization leaves" in plan.reason
    assert "stay on the compute stream" in plan.reason
    assert plan_staging(2, 448 * MIB, 100 * 2**30, 4 * 896 * MIB).use  # exactly a quarter still fits


def test_plan_falls_back_when_the_device_lacks_free_memory():
    """Without a known budget only free memory (minus headroom) decides; too little: direct copies."""
    assert plan_staging(1, 448 * MIB, 448 * MIB + FREE_HEADROOM_BYTES, None).use
    plan = plan_staging(1, 448 * MIB, 448 * MIB + FREE_HEADROOM_BYTES - 1, None)
    assert not plan.use and "the device has 960 MiB free" in plan.reason
    with pytest.raises(ValueError, match="at least one buffer, got 0"):
        plan_staging(0, 448 * MIB, 2**40, None)


def test_copier_refuses_a_plan_that_does_not_stage():
    """A fallback plan never builds staging buffers."""
    with pytest.raises(ValueError, match="staging was not planned: too big"):
        StagingCopier(
            StagingPlan(False, 2, 1, "too big"), (1, 1, 1), torch.float32, torch.device("cpu"), streams=FakeStreams()
        )


def test_copier_orders_fill_drain_and_buffer_reuse_by_events():
    """Fill on compute, drain on the copy stream after the staged event; a buffer is refilled only after its drain."""
    copier, streams, results = run_copier(LoggingCopier, 2, [16, 5, 16, 1, 9, 16, 2])
    check_order(streams.log, buffers=2)
    for aux, total, dst, event in results:
        assert torch.equal(dst, torch.stack([a[:total] for a in aux])), total
        assert event.recorded_on == "copy"
    copier.close()
    assert copier.buffers == []
    assert all(event.synchronized for *_, event in results[-2:])  # the last drain of each buffer


def test_order_check_catches_a_copier_that_reuses_a_buffer_too_early():
    """The order check is not vacuous: a copier without the reuse wait fails it."""
    _, streams, _ = run_copier(NoReuseWaitCopier, 2, [16, 16, 16])
    with pytest.raises(AssertionError):
        check_order(streams.log, buffers=2)


def test_one_buffer_waits_for_its_own_previous_drain():
    """With one buffer every step after the first waits on the compute stream for the previous drain."""
    _, streams, _ = run_copier(LoggingCopier, 1, [4, 4, 4])
    check_order(streams.log, buffers=1)
    assert sum(1 for entry in streams.log if entry[:2] == ("wait", "compute")) == 2


def prove(rows: torch.Tensor, dtype=torch.bfloat16) -> float:
    """The proof ``copy`` hands back for one step of ``rows`` ``[layers, total, hidden]`` (fake streams, CPU)."""
    layers, total, hidden = rows.shape
    plan = StagingPlan(True, 2, 0, "test")
    copier = StagingCopier(plan, (layers, total + 3, hidden), dtype, torch.device("cpu"), streams=FakeStreams())
    aux = [torch.cat([layer, torch.full((3, hidden), float("nan"), dtype=dtype)]) for layer in rows.to(dtype)]
    dst, proof = torch.empty((layers, total, hidden), dtype=dtype), torch.full((), -1.0)
    copier.copy(aux, total, dst, proof)
    assert torch.equal(dst.view(torch.int16), rows.to(dtype).view(torch.int16))
    return float(proof)


def test_the_proof_is_finite_exactly_for_finite_rows():
    """A step's float32 sum is finite for finite rows; one NaN, +Inf, -Inf or both infinities make it not."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 40, 16, generator=gen) * 1e3
    assert torch.isfinite(torch.tensor(prove(rows)))  # the padding rows past ``total`` (NaN) are not summed
    for bad in ([float("nan")], [float("inf")], [-float("inf")], [float("inf"), -float("inf")]):
        faulty = rows.clone()
        for k, value in enumerate(bad):
            faulty[2, 17 + k, 5] = value
        assert not torch.isfinite(torch.tensor(prove(faulty))), bad


def test_an_overflowing_sum_leaves_finite_rows_unproven():
    """Finite values whose sum overflows float32 are not proven (the writers then test their bytes)."""
    rows = torch.full((2, 8, 4), 3e38)
    assert torch.isfinite(rows.to(torch.bfloat16).float()).all()
    assert not torch.isfinite(torch.tensor(prove(rows)))


def prove_fp8(rows: torch.Tensor) -> tuple[float, Fp8Buffers]:
    """The proof and the slot of one FP8 step of ``rows`` ``[layers, total, hidden]`` (bf16, fake streams)."""
    layers, total, hidden = rows.shape
    plan = StagingPlan(True, 2, 0, "test")
    shape = (layers, total + 3, hidden)
    copier = StagingCopier(plan, shape, torch.bfloat16, torch.device("cpu"), streams=FakeStreams(), fp8=True)
    aux = [torch.cat([layer, torch.full((3, hidden), float("nan"))]).to(torch.bfloat16) for layer in rows]
    dst = Fp8Buffers(torch.empty((layers, total, hidden), dtype=fp8.CODE_DTYPE), torch.empty((layers, total)))
    proof = torch.full((), -1.0)
    copier.copy(aux, total, dst, proof)
    return float(proof), dst


def test_the_fp8_proof_is_finite_exactly_for_finite_rows():
    """FP8: the scales' sum is finite for finite rows (their codes never NaN); a NaN, +Inf or -Inf fails it."""
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(3, 40, 16, generator=gen) * 1e3
    rows[1, 7] = torch.finfo(torch.bfloat16).max  # the largest finite rows still quantize to finite codes
    rows[1, 8, ::2] = -torch.finfo(torch.bfloat16).max
    rows[2, 9] = 0.0
    rows[0, 3] = torch.finfo(torch.bfloat16).tiny
    proof, dst = prove_fp8(rows)
    assert torch.isfinite(torch.tensor(proof))  # the padding rows past ``total`` (NaN) are not summed
    assert not fp8.code_is_nan(dst.codes).any()
    codes, scales = fp8.quantize(rows.to(torch.bfloat16))
    assert torch.equal(dst.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(dst.scales, scales)
    for bad in (float("nan"), float("inf"), -float("inf")):
        faulty = rows.clone()
        faulty[2, 17, 5] = bad
        proof, dst = prove_fp8(faulty)
        assert not torch.isfinite(torch.tensor(proof)), bad
        assert not torch.isfinite(dst.scales[2, 17]), bad  # what the writers' test would have found


class TorchOnePass:
    """Stands in for worker/staged_sum.py on CPU (its Triton kernel runs on CUDA only): the same contract in torch,
    each call logged on the stream it is issued on; ``refuse`` names layers whose rows it does not take."""

    def __init__(self, streams: FakeStreams, refuse: int | None = None):
        self.streams, self.refuse, self.calls = streams, refuse, 0

    def usable(self, rows, staged, partials):
        return rows.shape[1] != self.refuse

    def copy_and_add(self, rows, staged, partials):
        self.calls += 1
        staged.copy_(rows)
        partials[self.calls % partials.numel()] += rows.float().sum()
        self.streams.log.append(("one-pass", self.streams.current))


def one_pass_copier(monkeypatch, refuse: int | None = None):
    from speculators_v016.worker import staging  # noqa: PLC0415 - its kernel lookup replaced for this test

    streams = FakeStreams()
    kernel = TorchOnePass(streams, refuse)
    monkeypatch.setattr(staging, "_one_pass_kernel", lambda: kernel)
    copier = LoggingCopier(StagingPlan(True, 2, 0, "test"), (3, 16, 8), torch.float32, torch.device("cpu"), streams)
    assert copier.fill_path == "copy, then sum (a cpu device)"  # CPU: never the kernel of its own accord
    copier._one_pass = True
    return copier, streams, kernel


def test_the_one_pass_fill_runs_on_the_compute_stream_before_the_staged_event(monkeypatch):
    """With the one-pass kernel a step's rows are copied and summed on the compute stream after the buffer's last
    drain and before its staged event; each buffer's partials start from zero, so a NaN step leaves the next
    step on that buffer proven."""
    copier, streams, kernel = one_pass_copier(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    proofs = []
    for step in range(4):
        aux = [torch.randn(16, 8, generator=gen) for _ in range(3)]
        if step == 1:
            aux[2][4, 3] = float("nan")
        dst, proof = torch.empty((3, 10, 8)), torch.full((), -1.0)
        copier.copy(aux, 10, dst, proof)
        assert torch.equal(dst.view(torch.int32), torch.stack([a[:10] for a in aux]).view(torch.int32))
        proofs.append(float(proof))
        if step == 0:
            assert abs(proofs[0] - float(torch.stack([a[:10] for a in aux]).double().sum())) < 1e-4
    assert kernel.calls == 12 and not any(entry[0] == "fill" for entry in streams.log)
    assert [torch.isfinite(torch.tensor(p)).item() for p in proofs] == [True, False, True, True]
    i = 0
    for step in range(4):  # per step: [wait on the buffer's drain,] three one-pass calls on compute, then staged
        if step >= 2:
            assert streams.log[i][:2] == ("wait", "compute"), streams.log[i]
            i += 1
        assert streams.log[i : i + 3] == [("one-pass", "compute")] * 3, streams.log[i : i + 4]
        assert streams.log[i + 3][:2] == ("record", "compute")
        i += 7  # staged, the copy stream's wait, drain, drained


def test_a_layer_the_kernel_does_not_take_sends_the_whole_step_to_two_passes(monkeypatch):
    """Where one layer's rows do not suit the kernel, nothing is one-pass: the step is filled and summed by torch."""
    copier, streams, kernel = one_pass_copier(monkeypatch, refuse=8)
    aux = [torch.randn(16, 8) for _ in range(3)]
    aux[1][2, 2] = float("inf")
    dst, proof = torch.empty((3, 5, 8)), torch.full((), -1.0)
    copier.copy(aux, 5, dst, proof)
    assert kernel.calls == 0 and ("fill", "compute", 0) in streams.log
    assert torch.equal(dst, torch.stack([a[:5] for a in aux])) and not torch.isfinite(torch.tensor(float(proof)))
