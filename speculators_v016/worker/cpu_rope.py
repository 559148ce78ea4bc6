"""Exact rotary embeddings for DeepSeek's plain-attention path on vLLM 0.16's CPU backend.

vLLM's CPU backend has no MLA; with ``VLLM_MLA_DISABLE=1`` DeepSeek-V2/V3 (and
Kimi-K2's text model) run ``DeepseekV2Attention``, which hands its rotary
embedding ``q_pe`` as a 3-D ``[tokens, heads, rope_dim]`` view of ``q``. The
CPU ``rotary_embedding`` kernel takes the head count from the last dimension
and the token stride from the one before, so it rotates ``q`` with the wrong
position for every head but the first (``k_pe`` has one head and comes out
right). Measured on a tiny DeepSeek-V3 in fp32: layer states off by 0.13 after
the first layer and up to 1.0 after four, against transformers; exact (1e-6)
with vLLM's own PyTorch-native rotary instead. Attention at position 0 sees
one key only, so position 0 hides it.

:func:`install` points those attention modules' rotary at vLLM's native
implementation, in the worker, on CPU only, before warm-up and compilation.
GPU workers run MLA (other code) and are never touched.
"""

from __future__ import annotations

import torch
from torch import nn

AFFECTED = ("DeepseekV2Attention",)  # plain-attention DeepSeek (MLA disabled)


def install(model: nn.Module, device: torch.device) -> int:
    """Use the native rotary in affected attention modules on CPU; return how many were switched."""
    if device.type != "cpu":
        return 0
    switched = 0
    for module in model.modules():
        rotary = getattr(module, "rotary_emb", None)
        if type(module).__name__ in AFFECTED and rotary is not None and hasattr(rotary, "forward_native"):
            rotary._forward_method = rotary.forward_native
            switched += 1
    return switched
