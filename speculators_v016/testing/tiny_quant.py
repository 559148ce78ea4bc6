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

:func:`build_tiny_w4a16_moe` writes the routed experts in Kimi-K2.5's own
checkpoint format (:data:`KIMI_K25_QUANTIZATION`): compressed-tensors
``pack-quantized``, 4-bit symmetric integers, one bf16 scale per group of 32
input channels, no activation quantization (W4A16). Per expert projection of
weight shape ``[out, in]``:

* ``weight_packed``: int32 ``[out, in / 8]``; word ``k`` of a row holds the
  codes of input channels ``8k .. 8k + 7``, channel ``8k + i`` in bits
  ``4i .. 4i + 3`` (the lowest nibble first), each code ``q`` in [-8, 7]
  stored as ``q + 8`` (offset binary), the word read as two's complement
  (compressed-tensors' ``pack_to_int32``, ``packed_dim`` 1);
* ``weight_scale``: bf16 ``[out, in / 32]``; the weight is ``q * scale``;
* ``weight_shape``: int32 ``[2]``, ``[out, in]``.

vLLM 0.16 reads these into its WNA16 MoE methods (``w13_weight_packed``
``[experts, in / 8, 2 * out]`` after a transpose, scales likewise). Everything
else (attention, the shared experts, the dense first MLP, the router gate,
embeddings, norms, ``lm_head``) is stored bf16 as Kimi-K2.5 ships it; the
router's correction bias stays float32.
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
    out: Path,
    arch: str,
    num_layers: int,
    kind: str,
    convert,
    quantization_config: dict,
    config_dtype: str | None = None,
    **overrides,
) -> tuple[Path, Path]:
    """Build ``out/dequantized`` (a tiny model) and ``out/<kind>`` from it.

    ``convert(name, tensor)`` returns None (keep the tensor in both) or
    ``(quantized tensors by name, the dequantized tensor)``. ``config_dtype``: the dtype ``out/<kind>``'s
    config declares (default: the tiny model's, float32).
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
    if config_dtype is not None:
        config["dtype"] = config_dtype
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


#: Kimi-K2.5's ``quantization_config`` (its ``text_config``'s; Kimi-K2.6 ships the same): routed experts only,
#: W4A16 group 32. ``ignore`` keeps attention, the shared experts, the dense first layer's MLP, ``lm_head`` and
#: the vision tower in bf16. The router gate needs no entry: in Kimi's modeling code it is not an ``nn.Linear``,
#: and vLLM 0.16 builds it with ``quant_config=None``.
KIMI_K25_QUANTIZATION = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
#: Per expert projection, the tensors of ``pack-quantized`` (``weight_shape`` last: vLLM reads it, then ignores it).
PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
INT4_PER_WORD = 8


def w4a16_config(group_size: int = 32) -> dict:
    """:data:`KIMI_K25_QUANTIZATION` with another group size (Kimi's is 32)."""
    config = json.loads(json.dumps(KIMI_K25_QUANTIZATION))
    config["config_groups"]["group_0"]["weights"]["group_size"] = group_size
    return config


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], ``[rows, cols]`` -> int32 ``[rows, cols / 8]`` in ``pack-quantized``'s layout: code
    ``8k + i`` of a row as ``code + 8`` in bits ``4i .. 4i + 3`` of word ``k``, the word read as two's complement."""
    if codes.dtype != torch.int8 or codes.dim() != 2 or codes.shape[1] % INT4_PER_WORD:
        raise ValueError(
            f"pack_int4: int8 [rows, cols] with cols a multiple of 8, got {codes.dtype} {tuple(codes.shape)}"
        )
    if int(codes.min()) < -8 or int(codes.max()) > 7:
        raise ValueError(f"pack_int4: codes outside [-8, 7] ({int(codes.min())}..{int(codes.max())})")
    nibbles = (codes.to(torch.int64) + 8).view(codes.shape[0], -1, INT4_PER_WORD)
    words = sum(nibbles[:, :, i] << (4 * i) for i in range(INT4_PER_WORD))
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[out, in]``: each code times its group's scale (exact: a 4-bit integer times a bf16 value)."""
    group = codes.shape[1] // scales.shape[1]
    return (codes.float().view(codes.shape[0], -1, group) * scales.float()[..., None]).view(codes.shape)


def build_tiny_w4a16_moe(
    out: str | Path, arch: str = "deepseek_v3_mla", *, num_layers: int = 4, group_size: int = 32, **overrides
) -> tuple[Path, Path]:
    """Write ``out/w4a16`` (routed experts in Kimi-K2.5's W4A16 ``pack-quantized`` format, the rest bf16) and
    ``out/dequantized`` (its exact float32 twin: the experts are the codes times their scales, every other
    weight the bf16 value the checkpoint holds); return both.

    ``arch``: a MoE of :mod:`~speculators_v016.testing.tiny_models` (default ``deepseek_v3_mla``: DeepSeek-V3,
    Kimi-K2.5's text architecture, with MLA's real latent geometry, so vLLM's GPU MLA kernels take it).
    """

    def convert(name: str, tensor: torch.Tensor):
        if re.search(EXPERT, name):
            codes, scales = quantize_symmetric(tensor, group_size)
            prefix = name.removesuffix(".weight")
            packed = {
                f"{prefix}.weight_packed": pack_int4(codes),
                f"{prefix}.weight_scale": scales,
                f"{prefix}.weight_shape": torch.tensor(list(tensor.shape), dtype=torch.int32),
            }
            return packed, dequantize_groups(codes, scales)
        if name.endswith("e_score_correction_bias") or not tensor.is_floating_point():
            return None  # float32 in Kimi's checkpoint too
        stored = tensor.to(torch.bfloat16)
        return {name: stored}, stored.float()

    return _quantized_pair(
        Path(out), arch, num_layers, "w4a16", convert, w4a16_config(group_size), "bfloat16", **overrides
    )
