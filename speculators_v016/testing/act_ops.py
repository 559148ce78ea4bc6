"""Torch stand-ins for every activation kernel vLLM 0.16's layers call through ``torch.ops._C`` (tests only).

vLLM's activation layers (``model_executor/layers/activation.py``) look their kernel up when the
layer is built, on CUDA: ``SiluAndMul`` (``silu_and_mul``), ``MulAndSilu`` (``mul_and_silu``),
``GeluAndMul`` (``gelu_and_mul``, ``gelu_tanh_and_mul``), ``FatreluAndMul`` (``fatrelu_and_mul``),
``NewGELU`` (``gelu_new``), ``FastGELU`` (``gelu_fast``), ``QuickGELU`` (``gelu_quick``); the lookup
fails on the GPU kit (its ``_C`` has none of them, or a placeholder that raises), so a family whose
MLP uses one stops at start even where ``custom_ops: ["none"]`` runs the layer's native forward.
The fused MoE calls ``silu_and_mul``, ``gelu_and_mul`` and ``swigluoai_and_mul`` directly
(``fused_moe/utils.py`` ``apply_moe_activation``), and ``SwigluOAIAndMul`` calls
``swigluoai_and_mul`` in its CUDA forward. ``SwigluStepAndMul`` runs a Triton kernel and ``ReLU2``
and ``XIELU`` torch: nothing to stand in.

Each stand-in writes its ``out`` argument as the kernel does, ``out`` ``[..., d]`` from
``input`` ``[..., 2 * d]`` (the ``*_and_mul`` ops: the activated half first, ``mul_and_silu``
the other way round, ``swigluoai_and_mul`` gate and up interleaved) or ``[...]`` from ``[...]``;
the activation in float32, rounded to the tensors' dtype (the gated ones: then multiplied in
that dtype, as the kernels). Checked against the plain formulas in ``tests/engine/test_act_ops.py``
and, where vLLM's CPU build has the kernel, against it. Pure torch, no host synchronization.
:func:`install` registers them as ``torch.library`` ops (traced by torch.compile where vLLM's
custom ops are on: they only write ``out``, so their fake implementation is trivial), only where
no compiled op of that name is loaded; the kit's placeholders are replaced. Call it in every
process that builds the model (see :mod:`speculators_v016.testing.moe_ops`, which calls it too).
This module is a test kit: no run imports it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from speculators_v016.testing.op_registry import empty_report, load_vllm_kernels, register

#: sqrt(2 / pi), gelu's tanh approximation
_TANH_SCALE = math.sqrt(2.0 / math.pi)


def _halves(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = input.shape[-1] // 2
    return input[..., :d], input[..., d:]


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.silu_and_mul``: ``out = silu(x) * y`` for ``input = [x, y]`` on the last dimension."""
    x, y = _halves(input)
    out.copy_(F.silu(x.float()).to(input.dtype) * y)


def mul_and_silu(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.mul_and_silu``: ``out = x * silu(y)`` for ``input = [x, y]``."""
    x, y = _halves(input)
    out.copy_(x * F.silu(y.float()).to(input.dtype))


def gelu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.gelu_and_mul``: ``out = gelu(x) * y`` (exact, erf) for ``input = [x, y]``."""
    x, y = _halves(input)
    out.copy_(F.gelu(x.float()).to(input.dtype) * y)


def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.gelu_tanh_and_mul``: ``out = gelu_tanh(x) * y`` for ``input = [x, y]`` (Gemma's MLP)."""
    x, y = _halves(input)
    out.copy_(F.gelu(x.float(), approximate="tanh").to(input.dtype) * y)


def fatrelu_and_mul(out: torch.Tensor, input: torch.Tensor, threshold: float = 0.0) -> None:
    """``_C.fatrelu_and_mul``: ``out = (x if x > threshold else 0) * y`` for ``input = [x, y]`` (MiniCPM-S)."""
    x, y = _halves(input)
    out.copy_(torch.where(x.float() > threshold, x, torch.zeros_like(x)) * y)


def swigluoai_and_mul(out: torch.Tensor, input: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> None:
    """``_C.swigluoai_and_mul`` (GPT-OSS): gate ``g = input[..., 0::2]`` clamped above at ``limit``, up
    ``u = input[..., 1::2]`` clamped to ``[-limit, limit]``, ``out = (u + 1) * g * sigmoid(alpha * g)``."""
    g = input[..., 0::2].float().clamp(max=limit)
    u = input[..., 1::2].float().clamp(min=-limit, max=limit)
    out.copy_(((u + 1.0) * g * torch.sigmoid(alpha * g)).to(out.dtype))


def gelu_new(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.gelu_new`` (GPT-2's): ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, elementwise."""
    x = input.float()
    out.copy_((0.5 * x * (1.0 + torch.tanh(_TANH_SCALE * (x + 0.044715 * x.pow(3))))).to(out.dtype))


def gelu_fast(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.gelu_fast``: ``0.5 x (1 + tanh(0.7978845608 x (1 + 0.044715 x^2)))``, elementwise."""
    x = input.float()
    out.copy_((0.5 * x * (1.0 + torch.tanh(0.7978845608 * x * (1.0 + 0.044715 * x * x)))).to(out.dtype))


def gelu_quick(out: torch.Tensor, input: torch.Tensor) -> None:
    """``_C.gelu_quick``: ``x * sigmoid(1.702 x)``, elementwise."""
    x = input.float()
    out.copy_((x * torch.sigmoid(1.702 * x)).to(out.dtype))


#: every activation op of vLLM 0.16's ``_C`` its layers reach (each writes ``out``)
OPS = {
    fn.__name__: fn
    for fn in (
        silu_and_mul,
        mul_and_silu,
        gelu_and_mul,
        gelu_tanh_and_mul,
        fatrelu_and_mul,
        swigluoai_and_mul,
        gelu_new,
        gelu_fast,
        gelu_quick,
    )
}


def install() -> dict[str, list[str]]:
    """Register the stand-ins as ``torch.ops._C.*`` where no compiled op of that name is loaded; idempotent.
    Returns ``{"installed": [...], "kept": [...]}`` (qualified names; kept: a compiled kernel stays)."""
    load_vllm_kernels()
    report = empty_report()
    for name, fn in OPS.items():
        register("_C", name, fn, ("out",), None, report)
    return report
