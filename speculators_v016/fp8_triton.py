"""FP8 quantization of captured rows on a CUDA device in one pass: a Triton kernel, identical to the torch path.

:func:`speculators_v016.fp8.quantize_into` uses it for CUDA tensors when
Triton is there (vLLM's GPU installs have it). One program per row reads the
row once (any float dtype, exact in float32), takes its largest ``|value|``
(NaN if the row holds one, as ``torch.linalg.vector_norm`` gives), computes
the scale as the torch path does (``amax / 448`` by IEEE division, floored at
2**-126, 1 for a zero row), divides every element by it with IEEE division
(``div_rn``: never an approximate reciprocal) and rounds to e4m3 to nearest
even (``cvt.rn.satfinite``; in range the same as torch's cast), writing codes
and the scale. So the codes and scales are bit for bit those of the torch path
on a CPU (tested on an H200), from one read of the rows and one write of the
codes: about 3 bytes of memory traffic per element, where the torch operations
(norm, division with an e4m3 output) took several passes and a dozen launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speculators_v016.triton_rows import row_launch


@triton.jit
def _quantize_rows(rows, row_stride, codes, code_stride, scales, hidden, e4m3_max, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < hidden
    x = tl.load(rows + row * row_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)  # exact; NaN handled below (max may skip it)
    has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    scale = tl.math.div_rn(amax, e4m3_max)
    scale = tl.where(scale < min_scale, min_scale, scale)  # NaN compares false: stays NaN
    scale = tl.where(amax == 0.0, 1.0, scale)
    q = tl.math.div_rn(x, scale)
    tl.store(codes + row * code_stride + offsets, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=inside)
    tl.store(scales + row, scale)


def quantize_into(
    rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, e4m3_max: float, min_scale: float
) -> None:
    """``rows`` ``[T, hidden]`` (last dimension contiguous) into ``codes`` ``[T, hidden]`` e4m3 and ``scales``
    ``[T]``, with the constants of :mod:`speculators_v016.fp8`."""
    count, hidden = rows.shape
    if count == 0:
        return
    block, warps = row_launch(hidden)
    _quantize_rows[(count,)](
        rows, rows.stride(0), codes, codes.stride(0), scales, hidden, e4m3_max, min_scale, BLOCK=block, num_warps=warps
    )


def usable(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """The kernel's layout: 2-D rows and codes with contiguous rows, contiguous scales, one CUDA device."""
    return (
        rows.dim() == 2
        and codes.dim() == 2
        and scales.dim() == 1
        and rows.stride(-1) == 1
        and codes.stride(-1) == 1
        and scales.is_contiguous()
        and rows.device == codes.device == scales.device
        and rows.shape == codes.shape
        and scales.shape[0] == rows.shape[0]
        and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )
