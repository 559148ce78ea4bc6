"""The two Triton kernels (FP8 quantizer, one-pass staged copy and proof) under Triton's CPU interpreter.

CI has no GPU, so the GPU tier (tests/gpu) alone ran these kernels on a device; here their logic runs on every
stop: ``TRITON_INTERPRET=1`` (read when Triton is imported, hence a child process) executes the kernels' bodies
on CPU tensors. The interpreter's arithmetic is numpy's, not the device's PTX, so what this proves is the
kernels' indexing, masking, strides and dataflow (the device's rounding and NaN handling stay the GPU tier's to
prove). Skips where Triton is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, torch
from speculators_v016 import fp8, fp8_triton
from speculators_v016.worker import staged_sum

out = {}
gen = torch.Generator().manual_seed(0)
# the one-pass copy: a strided view at an odd width, every dtype, the bytes and the sum
for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32)):
    wide = (torch.randn(29, 1011, generator=gen) * 3).to(dtype)
    rows = wide[:, 4:1007]
    staged, partials = torch.full((29, 1003), 7, dtype=dtype), torch.zeros(8)
    staged_sum.copy_and_add(rows, staged, partials)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    out[name] = {
        "bytes": torch.equal(staged.view(bits), rows.contiguous().view(bits)),
        "sum": float(partials.double().sum()),
        "exact": float(rows.double().sum()),
        "scale": float(rows.double().abs().sum()),
    }
    faults = {}
    for label, plants in (("nan", [(3, 17, float("nan"))]), ("inf", [(28, 1002, float("inf"))]),
                          ("-inf", [(0, 0, -float("inf"))]), ("both", [(5, 5, float("inf")), (6, 6, -float("inf"))])):
        bad = rows.clone()
        for r, c, v in plants:
            bad[r, c] = v
        partials = torch.zeros(8)
        staged_sum.copy_and_add(bad, staged, partials)
        faults[label] = bool(torch.isfinite(partials.sum()))
    out[name]["finite_with_fault"] = faults
    partials = torch.zeros(8)
    staged_sum.copy_and_add(rows[:0], staged[:0], partials)  # no rows: no launch
    out[name]["empty"] = float(partials.abs().sum())
# the FP8 quantizer against the torch path
rows = (torch.randn(41, 777, generator=gen) * 9).to(torch.bfloat16)
rows[3] = 0
rows[4, 5] = float("nan")
codes, scales = torch.empty(41, 777, dtype=fp8.CODE_DTYPE), torch.empty(41)
fp8_triton.quantize_into(rows, codes, scales, fp8.E4M3_MAX, fp8.MIN_SCALE)
fp8.USE_TRITON = False
want_codes, want_scales = fp8.quantize(rows)
keep = torch.arange(41) != 4
out["fp8"] = {
    "scales": torch.equal(scales[keep], want_scales[keep]),
    "nan_row_scale_nan": bool(torch.isnan(scales[4])),
    "zero_row_scale": float(scales[3]),
}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_the_one_pass_kernel_copies_a_strided_view_bit_for_bit_and_sums_it(interpreted, dtype):
    """The staged rows are the source's bytes (a view with a longer row stride, an odd width) and the partials
    add up to the rows' sum."""
    got = interpreted[dtype]
    assert got["bytes"]
    assert abs(got["sum"] - got["exact"]) <= 1e-5 * got["scale"], got
    assert got["empty"] == 0.0


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_the_one_pass_kernel_leaves_no_fault_proven(interpreted, dtype):
    """A NaN, +Inf, -Inf (the first and the last value of the rows among them) or both infinities make the sum
    non-finite."""
    assert interpreted[dtype]["finite_with_fault"] == {"nan": False, "inf": False, "-inf": False, "both": False}


def test_the_fp8_kernel_scales_match_the_torch_path(interpreted):
    """The quantizer's scales equal the torch path's; a zero row's scale is 1, a NaN row's NaN. (Its codes are the
    GPU tier's to compare: the interpreter's e4m3 cast rounds values just under a power of two a binade down,
    -125.6 to -64 where the device and torch give -128.)"""
    got = interpreted["fp8"]
    assert got["scales"], got
    assert got["nan_row_scale_nan"] and got["zero_row_scale"] == 1.0
