"""The torch stand-in for FlexAttention's KV-cache write on the GPU kit (``reshape_and_cache_flash``), against a loop.

:mod:`speculators_v016.testing.cache_ops` stands in for vLLM's compiled ``_C_cache_ops.reshape_and_cache_flash``
(the GPU kit has none; ``tests/gpu/test_cli_gpu.py`` chooses FlexAttention through ``--engine-args``). Checked
on the CPU, laid out as vLLM 0.16's FlexAttention backend lays a step out (the cache ``[2, blocks, block_size,
kv_heads, head_size]`` unbound into keys and values, scattered slots, padding slots of -1, keys padded past the
slot mapping).
"""

import pytest
import torch

from speculators_v016.testing import cache_ops

BLOCKS, BLOCK, HEADS, HEAD = 6, 16, 2, 8


def step(tokens: int, padded: int, seed: int):
    """A step's keys and values (``padded`` rows, the first ``tokens`` real), its slot mapping (scattered slots
    past block 0, the last two padding: -1) and an unbound cache holding random earlier rows."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(padded, HEADS, HEAD, generator=g, dtype=torch.bfloat16)
    value = torch.randn(padded, HEADS, HEAD, generator=g, dtype=torch.bfloat16)
    slots = torch.randperm((BLOCKS - 1) * BLOCK, generator=g)[:tokens] + BLOCK
    slots[-2:] = -1
    cache = torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, generator=g, dtype=torch.bfloat16)
    return key, value, slots, cache


def looped(key, value, slots, cache) -> torch.Tensor:
    """The write, one token at a time."""
    out = cache.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[0, slot // BLOCK, slot % BLOCK] = key[i]
            out[1, slot // BLOCK, slot % BLOCK] = value[i]
    return out


@pytest.mark.parametrize("tokens, padded", [(20, 20), (20, 32), (3, 8)])
def test_the_write_equals_a_loop(tokens, padded):
    """Every real token lands in its slot, padding slots and rows past the mapping write nothing."""
    key, value, slots, cache = step(tokens, padded, seed=tokens + padded)
    expected = looped(key, value, slots, cache)
    key_cache, value_cache = cache.unbind(0)
    scale = torch.ones(())
    calls = cache_ops.CALLS["reshape_and_cache_flash"]
    cache_ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", scale, scale)
    assert torch.equal(cache, expected)
    assert cache_ops.CALLS["reshape_and_cache_flash"] == calls + 1
    assert not torch.equal(cache, step(tokens, padded, seed=tokens + padded)[3])  # it wrote something


def test_an_fp8_cache_is_refused_by_name():
    """An FP8 KV cache: NotImplementedError naming the dtype, the cache untouched."""
    key, value, slots, cache = step(4, 4, seed=1)
    before = cache.clone()
    key_cache, value_cache = cache.unbind(0)
    scale = torch.ones(())
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8_e4m3'"):
        cache_ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "fp8_e4m3", scale, scale)
    assert torch.equal(cache, before)


def test_rows_of_another_shape_are_refused():
    """Keys whose heads do not match the cache's: ValueError naming both shapes."""
    key, value, slots, cache = step(4, 4, seed=2)
    key_cache, value_cache = cache.unbind(0)
    scale = torch.ones(())
    with pytest.raises(ValueError, match=r"keys of \(2, 4\)"):
        cache_ops.reshape_and_cache_flash(
            key[..., :4], value[..., :4], key_cache, value_cache, slots, "auto", scale, scale
        )
