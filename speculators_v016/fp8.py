"""FP8 (e4m3) storage of hidden states: one float32 scale per token per layer.

``scale = amax(|row|) / 448`` (448 is e4m3's largest finite value), floored at
float32's smallest normal number (so a tiny row never overflows the codes),
and ``1.0`` for a row of zeros (its codes are 0: it dequantizes to exact
zeros). Codes are ``float8_e4m3fn(row / scale)``: one IEEE float32 division
per element, rounded to nearest even. A row holding NaN or Inf gets a NaN or
Inf scale, so a non-finite row always shows in its scale.

Every step is exact or IEEE-rounded, so the result does not depend on where
it runs: the row's largest |value| (exact in any dtype), two float32 divisions
(``amax / 448``, then each element by its row's scale; both by tensors, never
by a Python scalar, which CUDA turns into a multiplication by a rounded
reciprocal) and the round-to-nearest-even cast to e4m3. On CUDA one Triton
kernel does it all in one pass (:mod:`speculators_v016.fp8_triton`, where
Triton is installed); the torch operations are the CPU path and the reference.
A GPU capture and a CPU reference give bit-identical codes and scales for the
same input (tested on an H200).

Dequantized, every element is within half an e4m3 step of the input: at most
``2**-4`` of its own magnitude (3 mantissa bits) in e4m3's normal range, and
``2**-10`` of the scale below it, so always within ``2**-4`` of the row's
amax (:data:`MAX_RELATIVE_ERROR`).

This module is neutral ground: the worker quantizes with it, the engine side
carries :class:`Fp8States`, the store writes and dequantizes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAME = "fp8_e4m3"
CODE_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
E4M3_MAX = 448.0
#: Smallest scale of a nonzero row: float32's smallest normal number (2**-126).
MIN_SCALE = torch.finfo(torch.float32).tiny
#: Largest |dequantized - original| of any element, relative to its row's amax.
MAX_RELATIVE_ERROR = 2.0**-4
#: How data_config.json and the files' metadata name the scaling.
SCALING = "per-token per-layer float32 scale = amax/448 (1 for a zero row); value = code * scale"


_FUSED: dict[str, bool] = {}  # device type -> whether the division writes e4m3 codes directly


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """``[..., hidden]`` -> ``[...]`` float32 scales: amax / 448 (at least 2**-126), 1 for an all-zero row."""
    amax = torch.linalg.vector_norm(rows, float("inf"), dim=-1).to(SCALE_DTYPE)  # max |x|: one pass, exact
    # a tensor divisor: CUDA multiplies by a rounded 1/448 when the divisor is a Python number
    scale = torch.div(amax, torch.full_like(amax, E4M3_MAX)).clamp_min_(MIN_SCALE)  # NaN, Inf stay
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize_into(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize ``rows`` (``[..., hidden]``, any float dtype) into ``codes`` (e4m3) and ``scales`` (float32).

    ``codes`` and ``scales`` live on the rows' device (a slot view, a staging
    buffer): the division writes the codes directly, with no float32 copy of
    the rows in between on CUDA.
    """
    if rows.is_cuda and _triton_kernel(rows, codes, scales):
        return
    s = row_scales(rows)
    scales.copy_(s)
    if _FUSED.get(rows.device.type, True):
        try:
            torch.div(rows, s.unsqueeze(-1), out=codes)
            return
        except RuntimeError:  # a torch without e4m3 outputs for div: the same values in two passes
            _FUSED[rows.device.type] = False
    codes.copy_(torch.div(rows, s.unsqueeze(-1)))


#: Whether CUDA tensors go through the Triton kernel (when it is installed); tests compare both paths.
USE_TRITON = True


def _triton_kernel(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Quantize with :mod:`speculators_v016.fp8_triton` if it applies; False where the torch path must."""
    if not USE_TRITON:
        return False
    try:
        from speculators_v016 import fp8_triton  # noqa: PLC0415 - Triton, CUDA only; without it the torch path
    except ImportError:  # no Triton: the torch operations, same values in more passes
        return False
    if not fp8_triton.usable(rows, codes, scales):
        return False
    fp8_triton.quantize_into(rows, codes, scales, E4M3_MAX, MIN_SCALE)
    return True


def warm_up(hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """Quantize one zero row of ``hidden`` ``dtype`` values on ``device``: a just-in-time kernel (Triton, on
    CUDA) is compiled now, at the engine's start, not in a run's first step (about half a second on an H200,
    inside the run's clock)."""
    rows = torch.zeros((1, hidden), dtype=dtype, device=device)
    quantize_into(rows, torch.empty((1, hidden), dtype=CODE_DTYPE, device=device),
                  torch.empty((1,), dtype=SCALE_DTYPE, device=device))  # fmt: skip


def quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``rows``: float8_e4m3fn ``[..., hidden]`` and float32 ``[...]``."""
    codes = torch.empty(rows.shape, dtype=CODE_DTYPE, device=rows.device)
    scales = torch.empty(rows.shape[:-1], dtype=SCALE_DTYPE, device=rows.device)
    quantize_into(rows, codes, scales)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Back to ``dtype``: ``code * scale``, computed in float32."""
    return (codes.to(SCALE_DTYPE) * scales.to(SCALE_DTYPE).unsqueeze(-1)).to(dtype)


def code_is_nan(codes: torch.Tensor) -> torch.Tensor:
    """Where e4m3fn codes are NaN (bit patterns ``s.1111.111``; e4m3fn has no Inf)."""
    return (codes.view(torch.uint8) & 0x7F) == 0x7F


@dataclass(frozen=True)
class Fp8States:
    """One layer's rows of one sample, stored in FP8: ``codes`` ``[T, hidden]`` e4m3 and ``scales`` ``[T]`` float32."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes, self.scales, dtype)

    def problems(self) -> list[str]:
        """What makes these states unusable: NaN/Inf (a non-finite scale or a NaN code), scales <= 0, shapes."""
        out = []
        if self.codes.dtype != CODE_DTYPE or self.scales.dtype != SCALE_DTYPE:
            out.append(f"codes {self.codes.dtype} / scales {self.scales.dtype}, expected {CODE_DTYPE} / {SCALE_DTYPE}")
            return out
        if self.codes.dim() != 2 or tuple(self.scales.shape) != tuple(self.codes.shape[:1]):
            out.append(
                f"codes {tuple(self.codes.shape)} and scales {tuple(self.scales.shape)} do not match "
                "([T, hidden] and [T])"
            )
            return out
        if not bool(torch.isfinite(self.scales).all()):
            out.append("NaN or Inf scales")
        elif not bool((self.scales > 0).all()):
            out.append("scales <= 0")
        if bool(code_is_nan(self.codes).any()):
            out.append("NaN codes")
        return out or self.invariant_problems()

    def invariant_problems(self) -> list[str]:
        """What the quantizer never produces, in finite codes and scales: a scale below 2**-126, a row of zero
        codes under a scale other than 1, a nonzero row whose largest |code| is not 448 (``scale = amax/448``
        puts the row's amax on 448, unless the scale was floored at 2**-126). Each names its first rows.
        A scale multiplied by a constant along with nothing else cannot be told from content, and is not here."""
        out = []
        small = torch.nonzero(self.scales < MIN_SCALE).flatten().tolist()
        if small:
            out.append(f"scales below 2^-126 in {_rows(small)}")
        amax = self.codes.to(SCALE_DTYPE).abs().amax(dim=-1) if self.codes.shape[1] else torch.zeros_like(self.scales)
        zero = amax == 0
        bad_zero = torch.nonzero(zero & (self.scales != 1)).flatten().tolist()
        if bad_zero:
            out.append(f"{_rows(bad_zero)} of zero codes under a scale other than 1")
        floored = self.scales == MIN_SCALE
        short = torch.nonzero(~zero & (amax != E4M3_MAX) & ~(floored & (amax < E4M3_MAX))).flatten().tolist()
        if short:
            out.append(f"{_rows(short)} whose largest |code| is not {E4M3_MAX:g} (the quantizer's scale = amax/448)")
        return out


def _rows(rows: list[int], shown: int = 8) -> str:
    return f"rows [{', '.join(map(str, rows[:shown]))}{', ...' if len(rows) > shown else ''}] ({len(rows)})"


def is_finite(states: torch.Tensor | Fp8States) -> bool:
    """No NaN/Inf in a layer's states (for FP8: finite positive scales and no NaN code)."""
    if isinstance(states, Fp8States):
        return bool(torch.isfinite(states.scales).all()) and not bool(code_is_nan(states.codes).any())
    return bool(torch.isfinite(states).all())


def as_float(states: torch.Tensor | Fp8States, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A layer's states as a float tensor (FP8 dequantized)."""
    return states.dequantize(dtype) if isinstance(states, Fp8States) else states.to(dtype)


def tensors_of(states: list) -> list[torch.Tensor]:
    """The tensors behind a sample's layers, in allocation order: FP8 codes of every layer, then their scales."""
    if states and isinstance(states[0], Fp8States):
        return [s.codes for s in states] + [s.scales for s in states]
    return list(states)


def row_values(states: torch.Tensor | Fp8States, index: int) -> torch.Tensor:
    """One row of a layer's states, as values (FP8: that row dequantized)."""
    if isinstance(states, Fp8States):
        return dequantize(states.codes[index : index + 1 or None], states.scales[index : index + 1 or None])[0]
    return states[index]
