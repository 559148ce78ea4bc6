"""Tiny INT4 targets built locally: AWQ (W4A16) dense and compressed-tensors W4A8 MoE, each with its twin.

Users' large targets serve quantized, so their drafts must learn the quantized
model's states. :func:`build_tiny_awq` takes a tiny random model of
:mod:`speculators_v016.testing.tiny_models`, quantizes every linear layer of its decoder
to 4 bits (asymmetric, one scale and zero point per group of input channels),
and writes two folders:

* ``awq/``: the checkpoint in AutoAWQ's GEMM layout (``qweight`` and ``qzeros``
  int32 with 8 nibbles packed in AutoAWQ's column order, ``scales`` fp16, a
  ``quantization_config`` with ``quant_method: awq``), which vLLM's CPU backend
  runs as ``cpu_awq``;
* ``dequantized/``: the same architecture unquantized, holding exactly the
  weights the 4-bit codes stand for, ``(q - z) * s``: the reference
  transformers (and vLLM) can load.

:func:`build_tiny_w4a8_moe` does the same for the routed experts of a MoE
model (a DeepSeek-V3, as Kimi-K2 is) in compressed-tensors' ``int-quantized``
format: symmetric 4-bit weights (held as int8 in [-8, 7]) with one bf16 scale
per group, 8-bit dynamic per-token activations: the INT4 MoE scheme vLLM 0.16's
CPU backend runs (``CompressedTensorsW4A8Int8MoEMethod``). Attention, the dense
layers and the shared experts stay unquantized, as in released INT4 MoE
checkpoints.

Scales are rounded to values both fp16 and bf16 represent exactly, so the
engine's bf16 copy of them is the same number.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculators_v016.testing.tiny_models import build_tiny_model

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs column 8k+AWQ_ORDER[i] into nibble i
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> codes [in, out] (0..15), zeros [in/g, out] (0..15), scales [in/g, out]."""
    w = weight.detach().float().T.contiguous()  # AWQ stores [in, out]
    groups = w.view(-1, group_size, w.shape[1])
    low, high = groups.amin(dim=1), groups.amax(dim=1)
    scales = ((high - low).clamp(min=1e-6) / 15).to(torch.bfloat16).to(torch.float32)  # fp16 == bf16 exactly
    zeros = torch.round(-low / scales).clamp(0, 15)
    codes = torch.round(groups / scales[:, None] + zeros[:, None]).clamp(0, 15).view_as(w)
    return codes.to(torch.int32), zeros.to(torch.int32), scales


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [out, in] weight that the codes stand for."""
    expand = lambda t: t.repeat_interleave(group_size, dim=0)  # noqa: E731
    return ((codes - expand(zeros)).float() * expand(scales)).T.contiguous()


def pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] nibbles -> [rows, cols/8] int32 in AutoAWQ's column order."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    packed = sum(v[:, :, i] << (4 * i) for i in range(8))
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # two's complement


def _quantized_pair(
    out: Path, arch: str, num_layers: int, kind: str, convert, quantization_config: dict, **overrides
) -> tuple[Path, Path]:
    """Build ``out/dequantized`` (a tiny model) and ``out/<kind>`` from it.

    ``convert(name, tensor)`` returns None (keep the tensor in both) or
    ``(quantized tensors by name, the dequantized tensor)``.
    """
    base = build_tiny_model(out / "dequantized", arch, num_layers=num_layers, **overrides)
    weights = load_file(str(base / "model.safetensors"))
    quantized, twin = {}, {}
    for name, tensor in weights.items():
        converted = convert(name, tensor)
        if converted is None:
            quantized[name] = twin[name] = tensor
        else:
            tensors, twin[name] = converted
            quantized.update(tensors)
    save_file(twin, str(base / "model.safetensors"), metadata={"format": "pt"})
    target = out / kind
    shutil.copytree(base, target, dirs_exist_ok=True)
    save_file(quantized, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target, base


def build_tiny_awq(
    out: str | Path, arch: str = "llama", *, num_layers: int = 4, group_size: int = 32, **overrides
) -> tuple[Path, Path]:
    """Write ``out/awq`` (INT4 AWQ checkpoint) and ``out/dequantized`` (its exact twin); return both."""

    def convert(name: str, tensor: torch.Tensor):
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
        if module not in QUANTIZED or tensor.dim() != 2:
            return None
        codes, zeros, scales = quantize(tensor, group_size)
        prefix = name.removesuffix(".weight")
        return (
            {
                f"{prefix}.qweight": pack(codes),
                f"{prefix}.qzeros": pack(zeros),
                f"{prefix}.scales": scales.to(torch.float16),
            },
            dequantize(codes, zeros, scales, group_size),
        )

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return _quantized_pair(Path(out), arch, num_layers, "awq", convert, config, **overrides)


EXPERT = r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"


def quantize_symmetric(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> int8 codes in [-8, 7] [out, in], bf16 scales [out, in/g]."""
    w = weight.detach().float()
    groups = w.view(w.shape[0], -1, group_size)
    scales = (groups.abs().amax(dim=-1).clamp(min=1e-6) / 7).to(torch.bfloat16)
    codes = torch.round(groups / scales.float()[..., None]).clamp(-8, 7).view_as(w)
    return codes.to(torch.int8), scales


def build_tiny_w4a8_moe(
    out: str | Path, arch: str = "deepseek_v3", *, num_layers: int = 4, group_size: int = 32, **overrides
) -> tuple[Path, Path]:
    """Write ``out/w4a8`` (routed experts INT4, compressed-tensors) and ``out/dequantized``; return both."""

    def convert(name: str, tensor: torch.Tensor):
        if not re.search(EXPERT, name):
            return None
        codes, scales = quantize_symmetric(tensor, group_size)
        twin = (codes.float().view(codes.shape[0], -1, group_size) * scales.float()[..., None]).view_as(tensor)
        return {name: codes, name.removesuffix(".weight") + ".weight_scale": scales}, twin

    config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        # vLLM refuses a linear layer that neither matches a target nor is ignored
        "ignore": [
            "lm_head",
            r"re:.*self_attn\..*",
            r"re:.*shared_experts\..*",
            r"re:.*mlp\.gate$",
            r"re:.*mlp\.(gate|up|down)_proj$",
        ],
        "config_groups": {
            "experts": {
                "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    }
    return _quantized_pair(Path(out), arch, num_layers, "w4a8", convert, config, **overrides)
