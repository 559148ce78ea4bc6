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
* decode tokens (``forward_mqa``): vLLM's Triton ``decode_attention_fwd``: nothing to stand in.

A prefill with earlier context (a prompt split over steps by chunked prefill) also needs
``gather_and_maybe_dequant_cache`` and ``merge_attn_states``: not stood in here; keep each prompt
within one step (``max_num_batched_tokens`` >= the prompts of a step) and that path stays unused
(it fails loudly where taken: the op is missing).

Each stand-in is pure torch, checked against plain loops in ``tests/unit/test_moe_ops.py``,
and never synchronizes with the host (decode steps run inside full CUDA graphs). Both are
called only inside vLLM's opaque attention op, never traced, so :func:`install` sets them
on the ``torch.ops`` namespaces as the kit sets its placeholders (FA2's op returns its
``out`` argument, which a ``torch.library`` op may not), only where no compiled op of that
name is loaded. Where to call it (uniprocess and ``mp`` executors): see
:mod:`speculators_v016.testing.moe_ops`. This module is a test kit: no run imports it.
"""

from __future__ import annotations

import torch

from speculators_v016.testing.moe_ops import load_vllm_kernels

#: Query rows per block of the attention stand-in (bounds its float32 score matrix).
QUERY_BLOCK = 1024


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
    (padding) are skipped. No FP8 cache (TRITON_MLA has none either)."""
    if kv_cache_dtype.startswith("fp8"):
        raise NotImplementedError(f"concat_and_cache_mla stand-in: kv_cache_dtype {kv_cache_dtype!r} (FP8 cache)")
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


#: (namespace, name) -> stand-in
OPS = {("_C_cache_ops", "concat_and_cache_mla"): concat_and_cache_mla, ("_vllm_fa2_C", "varlen_fwd"): varlen_fwd}


def install() -> dict[str, list[str]]:
    """Set the stand-ins on ``torch.ops._C_cache_ops`` and ``torch.ops._vllm_fa2_C`` where no compiled op of that
    name is loaded; idempotent. Returns ``{"installed": [...], "kept": [...]}`` (qualified names)."""
    load_vllm_kernels()
    report: dict[str, list[str]] = {"installed": [], "kept": []}
    for (namespace, name), fn in OPS.items():
        ns = getattr(torch.ops, namespace)
        if isinstance(getattr(ns, name, None), torch._ops.OpOverloadPacket):
            report["kept"].append(f"{namespace}::{name}")
            continue
        setattr(ns, name, fn)
        report["installed"].append(f"{namespace}::{name}")
    return report
