"""Torch stand-ins for the compiled kernels vLLM 0.16's MLA attention calls on CUDA with ``TRITON_MLA`` (tests only).

With MLA on (DeepSeek-V3, Kimi-K2: ``VLLM_MLA_DISABLE`` unset or 0) and the ``TRITON_MLA``
backend, vLLM's ``MLAAttention.forward_impl`` (inside its opaque
``torch.ops.vllm.unified_mla_attention_with_output`` op) runs:

* ``torch.ops._C_cache_ops.concat_and_cache_mla``: the latent ``kv_c`` and the rotary key ``k_pe``
  of each new token written into its KV-cache slot (every step, decode included);
* prefill tokens (``forward_mha``): on a GPU without FlashInfer (Hopper: FlashInfer/cuDNN/TRT-LLM
  prefill are Blackwell-only), ``vllm.vllm_flash_attn.flash_attn_varlen_func``, which calls
  ``torch.ops._vllm_fa2_C.varlen_fwd`` (the kit has no FA2 or FA3 library, so vLLM's version
  query answers None, v is padded to the q/k head size, and FA2 is the default);
* prefill tokens with earlier context (a prompt continued from an earlier step: chunked prefill),
  ``_compute_prefill_context``: per context chunk, ``torch.ops._C_cache_ops.gather_and_maybe_dequant_cache``
  copies the context's cache rows into the metadata builder's workspace, the new tokens attend to
  them without a causal mask through ``varlen_fwd`` (which returns the log-sum-exp), partial results
  of several context chunks are merged with ``torch.ops._C.merge_attn_states`` (routed there by
  ``v1/attention/ops/merge_attn_states.py`` on CUDA for fp32/fp16/bf16 and a head size that is a
  multiple of 16 bytes; otherwise vLLM's Triton kernel), and the context's result is merged with
  the new tokens' causal result by ``merge_attn_states`` again;
* decode tokens (``forward_mqa``): vLLM's Triton ``decode_attention_fwd``: nothing to stand in.

No FP8 KV cache: vLLM 0.16's ``TRITON_MLA`` refuses one (``supported_kv_cache_dtypes`` is ``auto``
and ``bfloat16``: vLLM's selector raises "Selected backend AttentionBackendEnum.TRITON_MLA is not
valid for this configuration. Reason: ['kv_cache_dtype not supported']", and ``TritonMLAImpl``
itself "TritonMLA V1 with FP8 KV cache not yet supported"), and the kit has none of the MLA
backends that take one; the stand-ins refuse ``fp8`` cache dtypes by name.

Each stand-in is pure torch, checked against plain loops in ``tests/engine/test_moe_ops.py`` and
``tests/engine/test_mla_ops.py``, and never synchronizes with the host (decode steps run inside full
CUDA graphs; the prefill ops run outside them, attention being a graph split, and read only host
values vLLM hands them: ``num_tokens``). All are called only inside vLLM's opaque attention op,
never traced, so :func:`install` sets them on the ``torch.ops`` namespaces as the kit sets its
placeholders (FA2's op returns its ``out`` argument, which a ``torch.library`` op may not), only
where no compiled op of that name is loaded. :data:`CALLS` counts their calls in this process (a
test proves a path was taken with it; calls captured in a CUDA graph count once). Where to call
:func:`install` (uniprocess and ``mp`` executors): see :mod:`speculators_v016.testing.moe_ops`.
This module is a test kit: no run imports it.
"""

from __future__ import annotations

from collections import Counter

import torch

from speculators_v016.testing.op_registry import set_attributes

#: Query rows per block of the attention stand-in (bounds its float32 score matrix).
QUERY_BLOCK = 1024
#: Calls of each stand-in in this process, by op name.
CALLS: Counter[str] = Counter()
#: Why an FP8 KV cache is refused (vLLM 0.16's own words).
FP8_REFUSED = (
    "an FP8 MLA KV cache: vLLM 0.16's TRITON_MLA refuses it ('TritonMLA V1 with FP8 KV cache not yet supported'; "
    "its selector: kv_cache_dtype not supported)"
)
#: The latent row widths vLLM's gather kernel takes (kv_lora_rank + rope: 512 + 64, 256 + 64).
GATHER_WIDTHS = (320, 576)


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    scale: torch.Tensor,
) -> None:
    """Stands in for vLLM's compiled ``_C_cache_ops.concat_and_cache_mla``: token ``i`` of ``kv_c``
    (``[tokens, kv_lora_rank]``) and ``k_pe`` (``[tokens, rope_dim]``) written as one row
    ``[kv_c | k_pe]`` at slot ``s = slot_mapping[i]`` of ``kv_cache`` (``[blocks, block_size,
    kv_lora_rank + rope_dim]``: block ``s // block_size``, row ``s % block_size``); negative slots
    (padding) are skipped. No FP8 cache (:data:`FP8_REFUSED`)."""
    CALLS["concat_and_cache_mla"] += 1
    if kv_cache_dtype.startswith("fp8"):
        raise NotImplementedError(f"concat_and_cache_mla stand-in: kv_cache_dtype {kv_cache_dtype!r}: {FP8_REFUSED}")
    tokens, block_size = kv_c.shape[0], kv_cache.shape[1]
    slots = slot_mapping.reshape(-1)[:tokens].long()
    valid = slots >= 0
    # A skipped token writes back what its (clamped) slot 0 holds: no host synchronization, and vLLM
    # never hands slot 0 to a request (block 0 is its null block).
    safe = slots.clamp(min=0)
    block, row = safe // block_size, safe % block_size
    new = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    kv_cache.index_put_((block, row), torch.where(valid.unsqueeze(-1), new, kv_cache[block, row]))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences in float32: ``(out [tq, heads, dv] in q's dtype,
    lse [heads, tq] float32)``. Sequence ``b`` holds queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and
    keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; causal: query ``i`` sees key ``j`` where
    ``j <= i + len_k - len_q`` (aligned to the bottom right, as FlashAttention). A row that sees no key
    gives 0 and an lse of +inf (FlashAttention's convention). Grouped k/v heads are repeated."""
    tq, heads, _ = q.shape
    tk, kv_heads, _ = k.shape
    if heads != kv_heads:
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    device = q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    seq_k = torch.searchsorted(cu_k[1:], torch.arange(tk, device=device), right=True)
    pos_k = torch.arange(tk, device=device) - cu_k[seq_k]
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for first in range(0, tq, QUERY_BLOCK):
        rows = torch.arange(first, min(tq, first + QUERY_BLOCK), device=device)
        seq_q = torch.searchsorted(cu_q[1:], rows, right=True)
        seen = seq_q.unsqueeze(1) == seq_k.unsqueeze(0)
        if causal:
            shift = (cu_k[seq_q + 1] - cu_k[seq_q]) - (cu_q[seq_q + 1] - cu_q[seq_q])
            seen &= pos_k.unsqueeze(0) <= (rows - cu_q[seq_q] + shift).unsqueeze(1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), kf) * softmax_scale
        scores = scores.masked_fill(~seen.unsqueeze(0), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf where a row sees nothing
        probs = torch.where(seen.unsqueeze(0), torch.exp(scores - lse.unsqueeze(-1)), 0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vf))
        lses.append(torch.where(torch.isneginf(lse), float("inf"), lse))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def varlen_fwd(
    q,
    k,
    v,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_k,
    leftpad_k,
    block_table,
    alibi_slopes,
    max_seqlen_q,
    max_seqlen_k,
    p_dropout,
    softmax_scale,
    zero_tensors,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    return_softmax,
    num_splits=0,
    gen=None,
):
    """Stands in for vLLM's compiled FlashAttention-2 ``_vllm_fa2_C.varlen_fwd`` (the arguments
    ``vllm.vllm_flash_attn.flash_attn_varlen_func`` passes it, in its order): :func:`varlen_attention`
    into ``out`` (or a new tensor), returning ``(out, softmax_lse)``. Paged keys (``seqused_k``,
    ``block_table``), ALiBi, dropout, soft-capping and sliding windows are refused by name."""
    CALLS["varlen_fwd"] += 1
    refused = {
        "seqused_k (paged keys)": seqused_k is not None,
        "block_table (paged keys)": block_table is not None,
        "leftpad_k": leftpad_k is not None,
        "alibi_slopes": alibi_slopes is not None,
        "dropout": p_dropout > 0,
        "softcap": softcap > 0,
        "sliding window": window_size_left >= 0 or window_size_right > 0,
    }
    for what, asked in refused.items():
        if asked:
            raise NotImplementedError(f"_vllm_fa2_C.varlen_fwd stand-in: {what} is not covered")
    result, lse = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, is_causal)
    if out is None:
        return result, lse
    out.copy_(result)
    return out, lse


def gather_and_maybe_dequant_cache(
    src_cache: torch.Tensor,
    dst: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    num_tokens,
    kv_cache_dtype: str,
    scale: torch.Tensor,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Stands in for vLLM's compiled ``_C_cache_ops.gather_and_maybe_dequant_cache`` (no FP8: :data:`FP8_REFUSED`).

    Row ``t < num_tokens`` of ``dst`` (``[workspace, width]``) gets the cache row of token
    ``p = t - cu_seq_lens[b] + seq_starts[b]`` of sequence ``b = token_to_seq[t]``: block
    ``block_table[b, p // block_size]``, row ``p % block_size`` of ``src_cache`` (``[blocks, block_size,
    width]``). MLA's metadata builder lays a context chunk out so: per prefill with context, its rows of
    the chunk one after the other (``cu_seq_lens``: their cumulative counts; ``token_to_seq``: the owner of
    each row, zero-padded past the chunk; ``seq_starts``: the chunk's first context position, a multiple
    of the block size; ``num_tokens``: the chunk's rows, a host value). Rows past ``num_tokens``, and a row
    past its sequence's end (``t >= cu_seq_lens[b + 1]``), are left as they are, as the kernel does. The
    kernel's checks are kept: int32 indices, a row width of 320 or 576, one device.
    """
    CALLS["gather_and_maybe_dequant_cache"] += 1
    if kv_cache_dtype.startswith("fp8"):
        raise NotImplementedError(
            f"gather_and_maybe_dequant_cache stand-in: kv_cache_dtype {kv_cache_dtype!r}: {FP8_REFUSED}"
        )
    named = {"block_table": block_table, "cu_seq_lens": cu_seq_lens, "token_to_seq": token_to_seq}
    if seq_starts is not None:
        named["seq_starts"] = seq_starts
    for what, tensor in named.items():
        if tensor.dtype != torch.int32:
            raise ValueError(f"gather_and_maybe_dequant_cache stand-in: {what} must be int32, not {tensor.dtype}")
        if tensor.device != src_cache.device:
            raise ValueError(f"gather_and_maybe_dequant_cache stand-in: {what} on {tensor.device}, the cache on "
                             f"{src_cache.device}")  # fmt: skip
    if dst.shape[-1] not in GATHER_WIDTHS or src_cache.shape[-1] != dst.shape[-1]:
        raise ValueError(f"gather_and_maybe_dequant_cache stand-in: rows of {tuple(src_cache.shape[2:])} into "
                         f"{dst.shape[-1]}; vLLM's kernel takes widths {GATHER_WIDTHS}")  # fmt: skip
    count = int(num_tokens)  # a host value (vLLM passes an int or a CPU tensor): no synchronization
    if count == 0:
        return
    device, block_size = dst.device, src_cache.shape[1]
    rows = torch.arange(count, device=device)
    seq = token_to_seq[:count].long()
    cu = cu_seq_lens.long()
    inside = rows < cu[seq + 1]
    position = rows - cu[seq]
    if seq_starts is not None:
        position = position + seq_starts.long()[seq]
    position = torch.where(inside, position, 0).clamp(min=0)  # rows left out read a harmless slot
    column = (position // block_size).clamp(max=block_table.shape[1] - 1)
    block = block_table.long()[seq, column]
    gathered = src_cache[block, position % block_size].to(dst.dtype)
    dst[:count] = torch.where(inside.unsqueeze(-1), gathered, dst[:count])


def merge_attn_states(
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> None:
    """Stands in for vLLM's compiled ``_C.merge_attn_states`` (its argument order: outputs first).

    Two partial attention results over disjoint key sets, ``[tokens, heads, head_size]`` with their
    log-sum-exps ``[heads, tokens]`` (float32), merged into ``output``: with ``M = max(lse_p, lse_s)``,
    ``w_p = exp(lse_p - M)``, ``w_s = exp(lse_s - M)``, ``output = (prefix * w_p + suffix * w_s) / (w_p +
    w_s)`` in float32, rounded once to ``output``'s dtype; ``output_lse = log(w_p + w_s) + M``. An lse of
    +inf (FlashAttention-2's "no key seen") counts as -inf (no weight). Where both are empty, ``output`` is
    the prefix and ``output_lse`` -inf (vLLM's kernel since it guarded that case; without the guard it gave
    NaN). The kernel reads the suffix with the prefix's strides: different layouts are refused, as are
    dtypes and head sizes it refuses (16-byte packs).
    """
    CALLS["merge_attn_states"] += 1
    if output.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"merge_attn_states stand-in: unsupported data type of O: {output.dtype}")
    pack = 16 // output.element_size()
    if output.shape[-1] % pack:
        raise ValueError(f"merge_attn_states stand-in: head size {output.shape[-1]} is not a multiple of {pack}")
    if prefix_output.stride() != suffix_output.stride():
        raise NotImplementedError(
            f"merge_attn_states stand-in: prefix strides {prefix_output.stride()} and suffix strides "
            f"{suffix_output.stride()} differ (vLLM's kernel reads both with the prefix's)"
        )
    minus_inf = float("-inf")
    p = torch.where(torch.isinf(prefix_lse), minus_inf, prefix_lse.float())
    s = torch.where(torch.isinf(suffix_lse), minus_inf, suffix_lse.float())
    top = torch.maximum(p, s)
    empty = torch.isinf(top)
    top = torch.where(empty, 0.0, top)
    w_p, w_s = torch.exp(p - top), torch.exp(s - top)
    total = torch.where(empty, 1.0, w_p + w_s)
    scale_p, scale_s = (w_p / total).t().unsqueeze(-1), (w_s / total).t().unsqueeze(-1)
    merged = prefix_output.float() * scale_p + suffix_output.float() * scale_s
    merged = torch.where(empty.t().unsqueeze(-1), prefix_output.float(), merged)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.where(empty, minus_inf, torch.log(total) + top))


#: (namespace, name) -> stand-in
OPS = {
    ("_C_cache_ops", "concat_and_cache_mla"): concat_and_cache_mla,
    ("_vllm_fa2_C", "varlen_fwd"): varlen_fwd,
    ("_C_cache_ops", "gather_and_maybe_dequant_cache"): gather_and_maybe_dequant_cache,
    ("_C", "merge_attn_states"): merge_attn_states,
}


def install() -> dict[str, list[str]]:
    """Set the stand-ins on ``torch.ops._C_cache_ops``, ``torch.ops._vllm_fa2_C`` and ``torch.ops._C`` where no
    compiled op of that name is loaded; idempotent. Returns ``{"installed": [...], "kept": [...]}`` (qualified
    names)."""
    return set_attributes(OPS)
