"""FP8 (e4m3) storage of hidden states: one float32 scale per token per layer.

``scale = amax(|row|) / 448`` (448 is e4m3's largest finite value), codes
``float8_e4m3fn(row / scale)``; a row of zeros gets scale 1 and codes 0, so it
dequantizes to exact zeros. The same torch operations run on CPU and on CUDA
(amax and one IEEE division per element, then a round-to-nearest-even cast),
so a GPU capture and a CPU reference give the same codes and scales.
Dequantized, each element is within half an e4m3 step of the input: at most
``2**-4`` of the row's amax (relative step 2**-3 at the top binade).
"""

from __future__ import annotations

import torch

CODE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
E4M3_MAX = 448.0
NAME = "fp8_e4m3"


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """``[..., hidden]`` -> ``[...]`` float32 scales (amax / 448; 1 for an all-zero row)."""
    amax = rows.abs().amax(dim=-1).to(SCALE_DTYPE)
    scale = amax / E4M3_MAX
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_into(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``rows`` (``[..., hidden]``, any float dtype) into preallocated ``codes`` and ``scales``."""
    s = row_scales(rows)
    scales.copy_(s)
    codes.copy_((rows.to(SCALE_DTYPE) / s.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(CODE_DTYPE))


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``rows``: float8_e4m3fn ``[..., hidden]`` and float32 ``[...]``."""
    codes = torch.empty(rows.shape, dtype=CODE_DTYPE, device=rows.device)
    scales = torch.empty(rows.shape[:-1], dtype=SCALE_DTYPE, device=rows.device)
    quantize_into(rows, codes, scales)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Back to ``dtype``: ``codes * scale`` (computed in float32)."""
    return (codes.to(SCALE_DTYPE) * scales.to(SCALE_DTYPE).unsqueeze(-1)).to(dtype)
