"""Torch stand-ins for the compiled kernels vLLM 0.16's Triton fused-MoE path calls on CUDA (tests only).

The GPU kit (``../shared/gpu-vllm``) carries vLLM's Python code without its compiled
libraries. For an unquantized bf16 MoE, vLLM 0.16 on CUDA picks the ``TRITON`` backend
(``oracle/unquantized.py``: no FlashInfer) and runs, per MoE layer, inside its opaque
``torch.ops.vllm.moe_forward(_shared)`` op:

* routing, softmax top-k (Mixtral, Qwen3-MoE; ``FusedTopKRouter``):
  ``torch.ops._moe_C.topk_softmax``; with a correction bias but no grouping
  (``FusedTopKBiasRouter``): ``topk_softmax`` / ``topk_sigmoid`` with the bias;
* routing, grouped (DeepSeek-V3, Kimi-K2; ``GroupedTopKRouter``): with
  ``VLLM_USE_FUSED_MOE_GROUPED_TOPK`` (default on), a bias, at most 32 groups and
  top-k <= 32, its ``torch.compile``-d ``grouped_topk`` calls
  ``torch.ops._moe_C.grouped_topk`` (traced by dynamo: the stand-in is a real
  ``torch.library`` op with a fake implementation); otherwise that function is torch;
* ``TritonExperts.apply``: ``torch.ops._moe_C.moe_align_block_size``, vLLM's Triton
  GEMM kernel twice, ``torch.ops._C.silu_and_mul`` (called directly by
  ``apply_moe_activation``: ``custom_ops: ["none"]`` does not avoid it; the kit's
  ``_C`` holds a placeholder that raises; stood in by
  :mod:`~speculators_v016.testing.act_ops`, which :func:`install` installs too) and
  ``torch.ops._moe_C.moe_sum``.

INT4 experts (compressed-tensors W4A16) reach ``_moe_C.moe_wna16_gemm`` and, on a real build,
Marlin: :mod:`speculators_v016.testing.wna16_ops`.

Each stand-in below is pure torch, computes what the kernel computes (checked against
plain loops in ``tests/engine/test_moe_ops.py``) and never synchronizes with the host,
so it can be captured in a CUDA graph (vLLM captures MoE layers inside its graphs).
:func:`install` registers them under the kernels' names, only where no compiled op of
that name is loaded (a real vLLM build keeps its kernels;
:mod:`speculators_v016.testing.op_registry`). This module is a test kit: no run imports it.

Where it must run: in every process that runs the model. With vLLM's uniprocess executor
(one GPU, our default there) the worker is the engine's own process: calling
:func:`install` before the engine starts is enough. vLLM's ``mp`` executor spawns its
workers (fresh interpreters): they need the call too, e.g. from a ``sitecustomize.py``
on their ``PYTHONPATH`` that runs ``from speculators_v016.testing import moe_ops;
moe_ops.install()`` (``PYTHONPATH`` is inherited by spawned workers).
"""

import torch

from speculators_v016.testing import act_ops
from speculators_v016.testing.op_registry import empty_report, load_vllm_kernels, register


def _topk_with_bias(topk_weights, topk_ids, token_expert_indices, scores, renormalize, bias) -> None:
    """Selection by ``scores + bias`` (or ``scores``), weights from the unbiased scores, written in place."""
    topk = topk_weights.shape[1]
    choice = scores if bias is None else scores + bias.float().unsqueeze(0)
    ids = torch.topk(choice, topk, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)
    rows = scores.shape[0]
    # the kernel's source-row map: entry (token i, choice k) = k * tokens + i
    token_expert_indices.copy_(
        torch.arange(topk, device=scores.device).unsqueeze(0) * rows
        + torch.arange(rows, device=scores.device).unsqueeze(1)
    )


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
) -> None:
    """Stands in for vLLM's compiled ``_moe_C.topk_softmax``: softmax over the experts in float32, the top-k
    (chosen by softmax + bias where a correction bias is given, weighted by the plain softmax), renormalized
    on request, written into ``topk_weights`` (float32), ``topk_ids`` and ``token_expert_indices``."""
    _topk_with_bias(
        topk_weights, topk_ids, token_expert_indices, gating_output.float().softmax(dim=-1), renormalize, bias
    )


def topk_sigmoid(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool = False,
    bias: torch.Tensor | None = None,
) -> None:
    """Stands in for vLLM's compiled ``_moe_C.topk_sigmoid``: as :func:`topk_softmax` with a sigmoid per expert."""
    _topk_with_bias(topk_weights, topk_ids, token_expert_indices, gating_output.float().sigmoid(), renormalize, bias)


def grouped_topk(
    scores: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor,
    scoring_func: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for vLLM's compiled ``_moe_C.grouped_topk`` (DeepSeek-V3's ``noaux_tc`` routing).

    ``scoring_func`` 1: ``scores`` are logits, sigmoid applied; 0: used as given. Each group is scored by
    the sum of its two best biased scores; the ``topk_group`` best groups are kept; the ``topk`` best
    biased scores among their experts are chosen, weighted by the unbiased scores, renormalized on
    request, times ``routed_scaling_factor``. Returns float32 weights and int32 ids, ``[tokens, topk]``.
    """
    values = scores.float().sigmoid() if scoring_func == 1 else scores.float()
    tokens, experts = values.shape
    biased = values + bias.float().unsqueeze(0)
    groups = biased.view(tokens, num_expert_group, experts // num_expert_group)
    group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)
    kept = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
    allowed = kept.unsqueeze(-1).expand_as(groups).reshape(tokens, experts).bool()
    ids = biased.masked_fill(~allowed, float("-inf")).topk(topk, dim=-1).indices
    weights = values.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * routed_scaling_factor).float(), ids.to(torch.int32)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> None:
    """Stands in for vLLM's compiled ``_moe_C.moe_align_block_size``: the (token, choice) pairs grouped by expert
    for the Triton MoE GEMM, each expert's group padded to a multiple of ``block_size``.

    The flattened pairs ``topk_ids.flatten()`` (index ``i = token * top_k + k``) are laid out expert by
    expert in ``sorted_token_ids``; expert ``e``'s segment starts at the sum of the padded counts of the
    experts before it (an expert without pairs has none); every other entry, padding included, is
    ``topk_ids.numel()`` (the GEMM masks ids >= that). ``expert_ids[b]`` is the expert of block ``b``
    (``sorted_token_ids[b * block_size : (b + 1) * block_size]``); blocks past the total are -1 (the
    Triton kernel stops at ``num_tokens_post_pad`` before reading them; -1 would make it write zeros).
    ``num_tokens_post_pad[0]`` is the padded total. Ids >= ``num_experts`` are left out, as the kernel
    does. Within an expert the pairs keep their flattened order (the kernel's order there is that of its
    atomics, which the GEMM does not depend on). No host synchronization (CUDA-graph safe).
    """
    if expert_map is not None:
        raise NotImplementedError("moe_align_block_size stand-in: expert_map (expert parallelism) is not covered")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # bucket num_experts: left out
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_experts] + block_size - 1) // block_size * block_size
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    start = counts.cumsum(0) - counts  # unpadded segment starts, bucket included
    rank = torch.arange(numel, device=device) - start[sorted_key]
    size = sorted_token_ids.numel()
    dest = torch.where(sorted_key < num_experts, padded_start[sorted_key.clamp(max=num_experts - 1)] + rank, size)
    staged = torch.full((size + 1,), numel, dtype=torch.long, device=device)  # slot `size`: the left-out pairs
    staged.scatter_(0, dest, order)
    sorted_token_ids.copy_(staged[:size])
    total = padded_end[-1]
    block_start = torch.arange(expert_ids.numel(), device=device) * block_size
    owner = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids.copy_(torch.where(block_start < total, owner, -1))
    num_tokens_post_pad.copy_(total.reshape(1))


def moe_sum(input: torch.Tensor, output: torch.Tensor) -> None:
    """Stands in for vLLM's compiled ``_moe_C.moe_sum``: ``output = input.sum(dim=1)`` (``[tokens, top_k, hidden]``
    -> ``[tokens, hidden]``; the kernel adds in the tensors' dtype, torch accumulates in float32 and rounds once)."""
    output.copy_(input.sum(dim=1))


def _grouped_topk_fake(
    scores: torch.Tensor,
    num_expert_group: int,
    topk_group: int,
    topk: int,
    renormalize: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor,
    scoring_func: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (scores.shape[0], topk)
    return scores.new_empty(shape, dtype=torch.float32), scores.new_empty(shape, dtype=torch.int32)


#: name -> (arguments the op writes, fake implementation for tracing), all in ``_moe_C``
_OPS = {
    "topk_softmax": (("topk_weights", "topk_ids", "token_expert_indices"), None),
    "topk_sigmoid": (("topk_weights", "topk_ids", "token_expert_indices"), None),
    "grouped_topk": ((), _grouped_topk_fake),
    "moe_align_block_size": (("sorted_token_ids", "expert_ids", "num_tokens_post_pad"), None),
    "moe_sum": (("output",), None),
}


def install() -> dict[str, list[str]]:
    """Register the stand-ins as ``torch.ops._moe_C.*`` where no compiled op of that name is loaded, and the
    activation stand-ins the fused MoE calls (:func:`speculators_v016.testing.act_ops.install`); idempotent.
    Returns ``{"installed": [...], "kept": [...]}`` (qualified names; kept: a compiled kernel of that name is
    loaded and stays)."""
    load_vllm_kernels()
    report = empty_report()
    for name, (mutates, fake) in _OPS.items():
        register("_moe_C", name, globals()[name], mutates, fake, report)
    activations = act_ops.install()
    return {key: report[key] + activations[key] for key in report}
