"""FP8 (e4m3) storage: the quantizer, the ring's slot layout, the worker's CPU capture and the assembler."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.capture import worker_setup
from speculators_v016 import fp8
from speculators_v016.checks.degenerate import degenerate_layers, may_be_degenerate
from speculators_v016.checks.finite import non_finite
from speculators_v016.engine.assembly import Assembler, AttributionError
from speculators_v016.fp8 import Fp8States
from speculators_v016.protocol import StepCapture
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.worker.capture import CaptureWorkerExtension
from speculators_v016.worker.staging import Fp8Buffers, StagingCopier, StagingPlan


def wide_rows(rows=64, hidden=256, dtype=torch.bfloat16, seed=0):
    """Rows spanning many binades, with outlier channels, as real hidden states have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * torch.exp2(torch.randint(-12, 4, (rows, 1), generator=gen))
    x[:, 7] *= 300  # a massive-activation channel
    x[::5, 100:140] = 0
    return x.to(dtype)


def e4m3_reference(values: torch.Tensor) -> torch.Tensor:
    """Nearest finite e4m3fn value by search over all codes (ties to the even code): independent of torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    table = codes.float()
    keep = torch.isfinite(table)
    table, bits = table[keep], torch.arange(256)[keep]
    distance = (values.double().reshape(-1, 1) - table.double()).abs()
    best = distance.min(1, keepdim=True).values
    tied = distance == best
    even = tied & (bits % 2 == 0)
    pick = torch.where(even.any(1, keepdim=True), even, tied).float().argmax(1)
    return table[pick].reshape(values.shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_codes_are_the_nearest_e4m3_of_row_over_scale(dtype):
    """Codes equal an exhaustive nearest-e4m3 search of x/scale; scales are amax/448 in float32."""
    x = wide_rows(dtype=dtype)
    codes, scales = fp8.quantize(x)
    amax = x.float().abs().amax(-1)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, torch.where(amax == 0, torch.ones_like(amax), amax / 448))
    assert torch.equal(codes.float(), e4m3_reference(x.float() / scales[:, None]))


def test_two_pass_fallback_gives_the_same_codes(monkeypatch):
    """Where torch cannot write e4m3 from the division, the two-pass path gives the same bytes."""
    x = wide_rows()
    fused = fp8.quantize(x)
    monkeypatch.setitem(fp8._FUSED, "cpu", False)
    codes, scales = fp8.quantize(x)
    assert torch.equal(codes.view(torch.uint8), fused[0].view(torch.uint8)) and torch.equal(scales, fused[1])


def test_dequantized_rows_are_within_the_e4m3_bound():
    """Every element is within 2**-4 of its row's amax, and within 2**-4 of itself in e4m3's normal range."""
    x = wide_rows(rows=512).float()
    back = Fp8States(*fp8.quantize(x)).dequantize()
    error = (back - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    assert (error <= fp8.MAX_RELATIVE_ERROR * amax).all()
    normal = x.abs() >= amax / 448 * 2**-6
    assert (error[normal] <= fp8.MAX_RELATIVE_ERROR * x.abs()[normal]).all()
    assert (error / amax).max() > 2**-5  # the bound is not vacuous: rounding reaches it closely


def test_zero_tiny_and_non_finite_rows():
    """A zero row dequantizes to exact zeros (scale 1); a tiny row stays finite; NaN/Inf rows show in their scale."""
    x = torch.zeros(4, 16)
    x[1] = 1e-44  # float32 subnormal: amax/448 would underflow
    x[2, 3], x[3, 5] = float("nan"), float("inf")
    codes, scales = fp8.quantize(x)
    assert scales[0] == 1 and torch.equal(Fp8States(codes[:1], scales[:1]).dequantize(), torch.zeros(1, 16))
    assert scales[1] == fp8.MIN_SCALE and not fp8.code_is_nan(codes[1]).any()
    assert fp8.is_finite(Fp8States(codes[:2], scales[:2]))
    assert not torch.isfinite(scales[2:]).any()
    assert not fp8.is_finite(Fp8States(codes[2:3], scales[2:3])) and not fp8.is_finite(Fp8States(codes[3:], scales[3:]))
    assert Fp8States(codes[2:3], scales[2:3]).problems() == ["NaN or Inf scales", "NaN codes"]


def test_quantize_into_slot_views_equals_quantize():
    """Quantizing into strided views of a slot gives the same bytes as fresh tensors."""
    x = wide_rows(rows=20)
    slot = torch.zeros(3, 32, 256, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(3, 32)
    fp8.quantize_into(x, slot[1, :20], scales[1, :20])
    codes, ref = fp8.quantize(x)
    assert torch.equal(slot[1, :20].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scales[1, :20], ref)
    assert not slot[0].view(torch.uint8).any() and not slot[1, 20:].view(torch.uint8).any()


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shm"])
def test_fp8_ring_slots_hold_codes_then_aligned_scales(shared):
    """An FP8 ring's slot is codes then 64-byte-aligned scales; a worker's mapping sees the engine's bytes."""
    ring = SlotRing.create(
        slots=3, num_ids=2, max_rows=5, hidden=7, dtype=torch.bfloat16, shared=shared, hidden_states_dtype="fp8_e4m3"
    )
    try:
        ring.buffer.zero_()  # a local ring is not zeroed at creation
        spec = ring.spec
        assert spec.states_bytes == 2 * 5 * 7 and spec.scales_offset == 128 and spec.slot_bytes == 128 + 64
        assert ring.slot(0).dtype == torch.float8_e4m3fn and ring.slot(0).shape == (2, 5, 7)
        assert ring.scales(2).dtype == torch.float32 and ring.scales(2).shape == (2, 5)
        worker = SlotRing.attach(spec)
        worker.scales(1)[1, 4] = 3.5
        worker.slot(1)[0, 0] = torch.full((7,), 2.0).to(torch.float8_e4m3fn)
        assert ring.scales(1)[1, 4] == 3.5 and (ring.slot(1)[0, 0].float() == 2).all()
        assert ring.scales(0).abs().sum() == 0 and ring.scales(2).abs().sum() == 0  # no overlap
        assert "e4m3 + 4 scale bytes" in spec.describe()
    finally:
        ring.close()


def test_auto_ring_keeps_the_engine_dtype():
    """Without FP8 a slot is the engine's dtype and has no scales."""
    ring = SlotRing.create(slots=2, num_ids=2, max_rows=4, hidden=8, dtype=torch.bfloat16, shared=False)
    assert ring.slot(1).dtype == torch.bfloat16 and ring.slot(1).shape == (2, 4, 8) and ring.scales(1) is None
    ring.close()


class CpuRunner:
    """What the capture reads of vLLM's CPU model runner, for one step."""

    device = torch.device("cpu")

    def step(self, aux, counts):
        bounds = np.cumsum([0, *counts])
        self.execute_model_state = SimpleNamespace(aux_hidden_states=aux)
        self.input_batch = SimpleNamespace(
            num_reqs=len(counts),
            req_ids=[f"r{i}" for i in range(len(counts))],
            num_computed_tokens_cpu=np.zeros(len(counts), dtype=np.int64),
        )
        self.query_start_loc = SimpleNamespace(np=bounds.astype(np.int32))


class Worker(CaptureWorkerExtension):
    def __init__(self):
        self.model_runner, self.rank = CpuRunner(), 0


@pytest.mark.parametrize("with_ring", [True, False], ids=["ring", "reply"])
def test_cpu_capture_quantizes_the_scheduled_rows(with_ring):
    """The worker's capture stores quantize(rows) of the scheduled tokens only, in the slot or in the reply."""
    ring = (
        SlotRing.create(
            slots=3,
            num_ids=2,
            max_rows=64,
            hidden=256,
            dtype=torch.bfloat16,
            shared=False,
            hidden_states_dtype="fp8_e4m3",
        )
        if with_ring
        else None
    )
    if ring:
        ring.buffer.zero_()
    worker = Worker()
    worker.speculators_capture_attach(worker_setup(2, ring.spec if ring else None, hidden_states_dtype="fp8_e4m3"))
    aux = [wide_rows(rows=64, seed=s) for s in (1, 2)]  # padded to 64 rows; 30 scheduled
    worker.model_runner.step(aux, [10, 20])
    assert worker.speculators_capture_step(1, 0 if ring else None) is None
    capture = worker.speculators_capture_flush()
    states = ring.slot(0)[:, :30] if ring else capture.states
    scales = ring.scales(0)[:, :30] if ring else capture.scales
    assert capture.counts == [10, 20] and tuple(states.shape) == (2, 30, 256)
    for j in range(2):
        codes, ref = fp8.quantize(aux[j][:30])
        assert torch.equal(states[j].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scales[j], ref)
    if ring:
        assert not ring.slot(0)[:, 30:].view(torch.uint8).any()
        ring.close()


def test_capture_refuses_a_ring_of_other_storage():
    """A worker set up for FP8 does not write into an engine-dtype ring."""
    ring = SlotRing.create(slots=2, num_ids=1, max_rows=4, hidden=8, dtype=torch.bfloat16, shared=False)
    with pytest.raises(RuntimeError, match="the capture ring stores 'auto', the capture was set up for 'fp8_e4m3'"):
        Worker().speculators_capture_attach(worker_setup(1, ring.spec, hidden_states_dtype="fp8_e4m3"))
    ring.close()


def fp8_capture(step, parts, rows):
    """A step of FP8 rows: ``parts`` are (request, start, count); ``rows`` [layers, positions, hidden] per request."""
    pieces = [rows[r][:, s : s + n] for r, s, n in parts]
    codes, scales = fp8.quantize(torch.cat(pieces, dim=1))
    return StepCapture(
        step, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], states=codes, scales=scales
    )


def test_assembler_stitches_fp8_chunks_into_whole_prompt_quantization():
    """Chunked FP8 captures stitch to exactly quantize(whole prompt): per-token scales do not depend on chunking."""
    rows = {r: torch.stack([wide_rows(rows=9, seed=10 * i + k) for k in range(3)]) for i, r in enumerate("ab")}
    asm = Assembler((2, 0), fp8=True)
    asm.add_request("a", "A", 9)
    asm.add_request("b", "B", 9)
    asm.expect(1, {"a": (0, 4), "b": (0, 9)})
    asm.add(fp8_capture(1, [("b", 0, 9), ("a", 0, 4)], rows))
    asm.expect(2, {"a": (4, 5)})
    asm.add(fp8_capture(2, [("a", 4, 5)], rows))
    done = dict(asm.pop_complete())
    for key, r in (("A", rows["a"]), ("B", rows["b"])):
        for states, layer in zip(done[key], (2, 0)):
            codes, scales = fp8.quantize(r[layer])
            assert isinstance(states, Fp8States)
            assert torch.equal(states.codes.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(states.scales, scales)


def test_assembler_refuses_captures_of_the_other_storage():
    """An FP8 run refuses a capture without scales; an engine-dtype run refuses one with scales."""
    rows = {"a": torch.stack([wide_rows(rows=4)])}
    asm = Assembler((0,), fp8=True)
    asm.add_request("a", "A", 4)
    asm.expect(1, {"a": (0, 4)})
    plain = StepCapture(1, ["a"], [0], [4], states=rows["a"].clone())
    with pytest.raises(AttributionError, match="FP8 storage needs torch.float8_e4m3fn codes"):
        asm.add(plain)
    asm = Assembler((0,))
    asm.add_request("a", "A", 4)
    asm.expect(1, {"a": (0, 4)})
    with pytest.raises(AttributionError, match="FP8 scales in a run that stores the engine's dtype"):
        asm.add(fp8_capture(1, [("a", 0, 4)], rows))


class NoStreams:
    """CPU stand-in for CUDA streams and events (the order of copies is tested in test_staging.py)."""

    class _Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    class _Stream:
        def wait_event(self, event):
            pass

    def compute(self):
        return self._Stream()

    def new_stream(self):
        return self._Stream()

    def new_event(self):
        return self._Event()

    def use(self, stream):
        return contextlib.nullcontext()


def test_fp8_staging_quantizes_as_its_device_step():
    """With FP8, staging buffers hold codes and scales: fill quantizes, drain copies both into the slot."""
    ring = SlotRing.create(
        slots=3, num_ids=2, max_rows=40, hidden=256, dtype=torch.bfloat16, shared=False, hidden_states_dtype="fp8_e4m3"
    )
    plan = StagingPlan(True, 2, ring.spec.slot_bytes, "test")
    copier = StagingCopier(plan, (2, 40, 256), torch.bfloat16, torch.device("cpu"), NoStreams(), fp8=True)
    assert all(isinstance(b, Fp8Buffers) and b.codes.dtype == fp8.CODE_DTYPE for b in copier.buffers)
    for step, rows in enumerate((40, 17, 33)):
        aux = [wide_rows(rows=40, seed=10 * step + j) for j in range(2)]
        slot = step % 3
        copier.copy(aux, rows, Fp8Buffers(ring.slot(slot)[:, :rows], ring.scales(slot)[:, :rows]))
        for j in range(2):
            codes, scales = fp8.quantize(aux[j][:rows])
            assert torch.equal(ring.slot(slot)[j, :rows].view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(ring.scales(slot)[j, :rows], scales)
    copier.close()
    ring.close()


def test_run_checks_see_fp8_layers():
    """The writer's NaN/Inf check and the self-check's degenerate screen read FP8 codes and scales."""
    good = Fp8States(*fp8.quantize(wide_rows(rows=6)))
    nan_scale = Fp8States(good.codes.clone(), good.scales.clone())
    nan_scale.scales[2] = float("nan")
    nan_code = Fp8States(good.codes.clone(), good.scales.clone())
    nan_code.codes.view(torch.uint8)[1, 3] = 0xFF
    assert non_finite([good, nan_scale, nan_code]) == [1, 2]
    ids = torch.arange(6)
    zero = Fp8States(*fp8.quantize(torch.zeros(6, 256)))
    repeated = Fp8States(*fp8.quantize(wide_rows(rows=1).expand(6, 256).contiguous()))
    assert not may_be_degenerate(ids, [good])
    assert may_be_degenerate(ids, [good, zero]) and may_be_degenerate(ids, [repeated])
    assert degenerate_layers(ids, [good, zero, repeated]) == [
        (1, "every value is 0"),
        (2, "all 6 positions hold the same row, though the tokens differ"),
    ]
