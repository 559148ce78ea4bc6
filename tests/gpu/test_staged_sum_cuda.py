"""The staged copy and its NaN/Inf proof in one Triton pass (worker/staged_sum.py) against the two torch passes.

Steps at Kimi's width (8192 rows x 4 layers x hidden 7168, bf16), fp16 and
float32 rows too: the staged and drained bytes equal the aux rows' bytes, the
proof equals the rows' sum, and a planted NaN, +Inf, -Inf or an infinity
beside its opposite makes it non-finite (past the step's rows it does not
count). The GPU time of both paths is printed (CUDA events), not asserted.
Skips without CUDA or Triton.
"""

from __future__ import annotations

import pytest
import torch

from helpers.gpu import save_figures
from speculators_v016.worker.staging import StagingCopier, StagingPlan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, ROWS, HIDDEN = 4, 8192, 7168


def copier(dtype: torch.dtype, hidden: int = HIDDEN, one_pass: bool = True) -> StagingCopier:
    pytest.importorskip("triton")
    plan = StagingPlan(True, 2, LAYERS * ROWS * hidden * dtype.itemsize, "test")
    staging = StagingCopier(plan, (LAYERS, ROWS, hidden), dtype, torch.device("cuda"))
    assert staging._one_pass, (
        f"Triton is installed: the staged path must take the one-pass kernel ({staging.fill_path})"
    )
    assert staging.fill_path == "copy and sum in one pass (Triton)"
    staging._one_pass = one_pass
    return staging


def stage(staging: StagingCopier, aux: list[torch.Tensor], total: int) -> tuple[torch.Tensor, float]:
    """Drain ``aux[j][:total]`` through ``staging`` into pinned host rows; return them and the proof. The step
    took the one-pass kernel exactly where ``staging`` was built for it (no quiet fall back to two passes)."""
    dst = torch.empty((LAYERS, ROWS, aux[0].shape[1]), dtype=aux[0].dtype, pin_memory=True)
    proof = torch.full((), 7.0, dtype=torch.float32, pin_memory=True)
    taken, real = [], staging.fill_and_prove
    staging.fill_and_prove = lambda *args: taken.append(real(*args)) or taken[-1]
    try:
        staging.copy(aux, total, dst, proof=proof).synchronize()
    finally:
        del staging.fill_and_prove
    assert taken == [staging._one_pass], taken
    return dst[:, :total], float(proof)


def rows(dtype: torch.dtype, hidden: int = HIDDEN, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(ROWS, hidden, device="cuda", generator=gen) * 3).to(dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("total", [ROWS, 5000, 1])
def test_one_pass_stages_the_rows_bit_for_bit_and_sums_them(dtype, total):
    """The one-pass kernel drains the aux rows' bytes unchanged, as the torch copy does, and its proof is their sum."""
    aux = rows(dtype, seed=total)
    aux[1][total - 1, 5] = -0.0  # a signed zero and a subnormal travel as bytes, not as values
    aux[2][0, 7] = torch.finfo(dtype).tiny / 4
    assert aux[2][0, 7] != 0 and torch.signbit(aux[1][total - 1, 5])
    fused, two = copier(dtype), copier(dtype, one_pass=False)
    (got, proof), (want, proof_two) = stage(fused, aux, total), stage(two, aux, total)
    expected = torch.stack([layer[:total] for layer in aux]).cpu()
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(got.view(bits), expected.view(bits))
    assert torch.equal(want.view(bits), expected.view(bits))
    exact = float(expected.double().sum())
    scale = float(expected.double().abs().sum())
    assert abs(proof - exact) <= 1e-5 * scale and abs(proof_two - exact) <= 1e-5 * scale, (proof, proof_two, exact)


@pytest.mark.parametrize(
    "plant",
    [[(2, 11, 3, float("nan"))], [(0, 4999, 0, float("inf"))], [(3, 982, 7167, -float("inf"))],
     [(1, 7, 1, float("inf")), (1, 8, 1, -float("inf"))]],
    ids=["nan", "+inf", "-inf", "inf-beside-its-opposite"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_planted_nan_or_inf_makes_the_proof_non_finite(plant, dtype):
    """A NaN, +Inf or -Inf in the step's rows (or +Inf and -Inf together) leaves the proof non-finite; past the
    step's rows it does not count; the drained rows still carry the planted value as it is."""
    staging, total = copier(dtype), 5000
    aux = rows(dtype, seed=9)
    for layer, row, column, value in plant:
        aux[layer][row, column] = value
    got, proof = stage(staging, aux, total)
    assert not torch.isfinite(torch.tensor(proof)), proof
    for layer, row, column, value in plant:
        assert torch.equal(got[layer, row, column].float(), torch.tensor(value)) or value != value
    clean = rows(dtype, seed=9)
    clean[0][total, 3] = float("nan")  # the next request's row: not part of this step
    assert torch.isfinite(torch.tensor(stage(staging, clean, total)[1]))


def test_rows_of_another_stride_and_an_odd_width_stage_bit_for_bit():
    """Aux rows that are a view with a longer row stride, at a width no multiple of 16 (a kernel variant of its own,
    compiled at set-up for the buffer's layout and again at the first step for this one): bytes and proof hold."""
    hidden, total = 7003, 3001
    staging = copier(torch.bfloat16, hidden)
    gen = torch.Generator(device="cuda").manual_seed(4)
    wide = [torch.randn(ROWS, hidden + 61, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    aux = [layer[:, 5 : 5 + hidden] for layer in wide]
    assert aux[0].stride(0) == hidden + 61 and not aux[0].is_contiguous()
    got, proof = stage(staging, aux, total)
    expected = torch.stack([layer[:total] for layer in aux]).cpu()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    exact = float(expected.double().sum())
    assert abs(proof - exact) <= 1e-5 * float(expected.double().abs().sum()), (proof, exact)
    wide[3][total - 1, 5 + hidden - 1] = float("nan")  # the last value of the step's last row
    assert not torch.isfinite(torch.tensor(stage(staging, aux, total)[1]))


def test_the_one_pass_gpu_time_against_two_passes():
    """GPU time of the fill and proof of a 448 MiB step, both paths (CUDA events, medians of 20), printed and kept
    as figures; not asserted (the benchmark's ratios decide)."""
    aux, times = rows(torch.bfloat16), {}
    for name, one_pass in (("two_passes", False), ("one_pass", True), ("two_passes_again", False)):
        staging = copier(torch.bfloat16, one_pass=one_pass)
        samples = []
        for _ in range(22):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if not staging.fill_and_prove(0, aux, ROWS):
                staging.fill(staging.buffers[0], aux, ROWS)
                staging.prove(staging.buffers[0], ROWS, staging.sums[0])
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times[name] = sorted(samples[2:])[len(samples[2:]) // 2]
    save_figures("staged-sum", {f"{k}_ms": round(v, 4) for k, v in times.items()})
