"""Torch stand-in for the compiled KV-cache write vLLM 0.16's FlexAttention backend calls on CUDA (tests only).

``FLEX_ATTENTION`` (chosen with ``--engine-args '{"attention_config": {"backend": "FLEX_ATTENTION"}}'``)
writes each step's new keys and values into the paged cache with
``torch.ops._C_cache_ops.reshape_and_cache_flash`` (inside vLLM's opaque attention op, never traced), then
attends with torch's own ``flex_attention``. The GPU kit has no compiled cache ops (its ``TRITON_ATTN``
writes the cache with a Triton kernel instead), so without this stand-in a FlexAttention run dies at its
first step: "'_OpNamespace' '_C_cache_ops' object has no attribute 'reshape_and_cache_flash'".

The stand-in is pure torch, checked against a plain loop in ``tests/engine/test_cache_ops.py``, never
synchronizes with the host, refuses an FP8 cache by name, and is set only where no compiled op of that
name is loaded (:func:`~speculators_v016.testing.op_registry.set_attributes`). :data:`CALLS` counts its
calls in this process. This module is a test kit: no run imports it.
"""

from __future__ import annotations

from collections import Counter

import torch

from speculators_v016.testing.op_registry import set_attributes

#: Calls of each stand-in in this process, by op name.
CALLS: Counter[str] = Counter()


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Stands in for vLLM's compiled ``_C_cache_ops.reshape_and_cache_flash``: token ``i`` of ``key`` and
    ``value`` (``[tokens, kv_heads, head_size]``) written at slot ``s = slot_mapping[i]`` of ``key_cache`` and
    ``value_cache`` (``[blocks, block_size, kv_heads, head_size]``: block ``s // block_size``, row
    ``s % block_size``); negative slots (padding) are skipped; only the first ``slot_mapping``'s length of
    tokens are written (vLLM pads ``key`` past it). No FP8 cache."""
    CALLS["reshape_and_cache_flash"] += 1
    if kv_cache_dtype != "auto" and not kv_cache_dtype.startswith(("bfloat16", "float16", "float32")):
        raise NotImplementedError(f"reshape_and_cache_flash stand-in: kv_cache_dtype {kv_cache_dtype!r} (no FP8)")
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        raise ValueError(
            f"reshape_and_cache_flash stand-in: keys of {tuple(key.shape[1:])} and values of "
            f"{tuple(value.shape[1:])} into caches of rows {tuple(key_cache.shape[2:])}, {tuple(value_cache.shape[2:])}"
        )
    slots = slot_mapping.reshape(-1).long()
    tokens, block_size = slots.shape[0], key_cache.shape[1]
    valid = (slots >= 0).view(-1, 1, 1)
    # A skipped token writes back what its (clamped) slot 0 holds: no host synchronization, and vLLM
    # never hands slot 0 to a request (block 0 is its null block).
    safe = slots.clamp(min=0)
    block, row = safe // block_size, safe % block_size
    for cache, new in ((key_cache, key), (value_cache, value)):
        rows = new[:tokens].to(cache.dtype)
        cache.index_put_((block, row), torch.where(valid, rows, cache[block, row]))


#: (namespace, name) -> stand-in
OPS = {("_C_cache_ops", "reshape_and_cache_flash"): reshape_and_cache_flash}


def install() -> dict[str, list[str]]:
    """Set the stand-in on ``torch.ops._C_cache_ops`` where no compiled op of that name is loaded; idempotent.
    Returns ``{"installed": [...], "kept": [...]}`` (qualified names)."""
    return set_attributes(OPS)
