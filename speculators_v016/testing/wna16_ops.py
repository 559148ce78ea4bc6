"""INT4/INT8 experts (compressed-tensors WNA16, Kimi-K2.5's format) on the GPU kit: a torch ``moe_wna16_gemm``,
and vLLM steered off Marlin where the Marlin kernels are absent (tests only).

Kimi-K2.5 ships its routed experts in compressed-tensors ``pack-quantized`` int4 (symmetric, group 32,
no activation quantization). vLLM 0.16 (``compressed_tensors_moe.py``,
``CompressedTensorsMoEMethod.get_moe_method``) serves such an MoE layer with
``CompressedTensorsWNA16MarlinMoEMethod`` wherever ``check_moe_marlin_supports_layer`` holds (Kimi's
shapes do), else with ``CompressedTensorsWNA16MoEMethod``. The Marlin method needs compiled kernels
(``_C.gptq_marlin_repack`` when the weights are loaded, ``_moe_C.moe_wna16_marlin_gemm`` per layer)
that the GPU kit (``../shared/gpu-vllm``) does not carry: such an engine dies at load. The other
method keeps the checkpoint's codes (``[E, N, K / 2]`` bytes after loading, two 4-bit codes a byte,
the even ``k`` in the low nibble; scales ``[E, N, K / group]``; stored ``code = value + 8``) and runs
vLLM's fused MoE with them: its Triton kernel ``fused_moe_kernel_gptq_awq``, except that
``dispatch_fused_moe_kernel`` calls the compiled ``_moe_C.moe_wna16_gemm`` on CUDA when
``tokens * top_k / experts <= 6`` (4-bit, group 32/64/128): every decode-sized step.

* :func:`moe_wna16_gemm` stands in for that kernel (torch, no host synchronization: it runs inside
  CUDA graphs); :func:`install` registers it where no compiled op of that name is loaded.
* :func:`steer_away_from_absent_marlin` makes ``check_moe_marlin_supports_layer`` answer False in
  ``compressed_tensors_moe`` (the name ``get_moe_method`` calls), only where the Marlin kernels are
  absent, so that vLLM picks ``CompressedTensorsWNA16MoEMethod`` instead of dying at load. Why here and
  not in a run: a real vLLM build has Marlin and must keep choosing it (what production serves), and the
  capture does not depend on the expert kernel (the taps read the residual stream between decoder
  layers; the start-up stream proof and the logit check run on whatever kernels the engine has). Only
  the test kit calls it, in the processes that build the model (see
  :mod:`speculators_v016.testing.moe_ops` for where that is).

Both are tested on CPU (``tests/engine/test_wna16_ops.py``): the GEMM against a dequantize-then-matmul
loop and through vLLM's own ``invoke_fused_moe_wna16_cuda_kernel``; the steering through vLLM's own
``get_moe_method``, with a registered Marlin op left alone. This module is a test kit: no run imports it.
"""

from __future__ import annotations

from collections import Counter

import torch

from speculators_v016.testing.op_registry import compiled, empty_report, load_vllm_kernels, register

#: Calls of the stand-in in this process, by op name (its Python body: eager steps, and the captures of CUDA graphs,
#: whose replays run it without Python).
CALLS: Counter[str] = Counter()
#: Calls the compiled kernel itself refuses ("BLOCK_SIZE_K // group_size must be one of [1, 2, 4, 8]") and the
#: stand-in computes: vLLM 0.16's block config for the CUDA WNA16 path picks BLOCK_SIZE_K 512 at K = 7168 with
#: groups of 32 (Kimi-K2.5's experts: 16 groups a block), so a vLLM 0.16 build without Marlin fails Kimi's
#: decode-sized MoE steps there. A real build serves Kimi's experts through Marlin and never takes this path;
#: the kit computes the same product (the block size only tiles the kernel's work) and counts it here.
KERNEL_REFUSES = "moe_wna16_gemm: BLOCK_SIZE_K // group not 1, 2, 4 or 8 (the compiled kernel refuses)"
#: What vLLM's Marlin MoE method calls: ``(namespace, name)``; absent any of them, vLLM is steered off it.
MARLIN_OPS = (("_moe_C", "moe_wna16_marlin_gemm"), ("_C", "gptq_marlin_repack"))
#: Bytes one pass of :func:`moe_wna16_gemm` may hold while it dequantizes its blocks' experts (about six float32
#: copies of their weights); more blocks run in several passes.
PASS_BYTES = 1 << 30


def dequantize_wna16(
    qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, bit: int, size_k: int
) -> torch.Tensor:
    """``[..., N, K]`` float32 weights from moe_wna16 codes: ``qweight`` ``[..., N, K * bit / 8]`` bytes (4-bit: the
    even ``k`` in the low nibble), ``scales`` ``[..., N, K / group]``, ``qzeros`` (optional) ``[..., N / 2, K /
    group]`` bytes (4-bit: even ``n`` low) or ``[..., N, K / group]`` (8-bit); without zero points the codes are
    offset by 8 (4-bit) or 128 (8-bit). ``weight = (code - zero) * scale``."""
    codes = qweight.to(torch.int32)
    if bit == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)
    codes = codes[..., :size_k].float()
    group = size_k // scales.shape[-1]
    if qzeros is None:
        zeros = torch.full_like(scales, 8.0 if bit == 4 else 128.0, dtype=torch.float32)
    else:
        zeros = qzeros.to(torch.int32)
        if bit == 4:
            zeros = torch.stack([zeros & 0xF, zeros >> 4], dim=-2).flatten(-3, -2)
        zeros = zeros[..., : scales.shape[-2], :].float()
    per_k = lambda t: t.repeat_interleave(group, dim=-1)  # noqa: E731 - one group value per k
    return (codes - per_k(zeros)) * per_k(scales.float())


def moe_wna16_gemm(
    input: torch.Tensor,
    output: torch.Tensor,
    b_qweight: torch.Tensor,
    b_scales: torch.Tensor,
    b_qzeros: torch.Tensor | None,
    topk_weights: torch.Tensor | None,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    top_k: int,
    BLOCK_SIZE_M: int,  # noqa: N803 - the kernel's argument names
    BLOCK_SIZE_N: int,  # noqa: N803
    BLOCK_SIZE_K: int,  # noqa: N803
    bit: int,
) -> None:
    """Stands in for vLLM's compiled ``_moe_C.moe_wna16_gemm`` (the arguments ``vllm._custom_ops.moe_wna16_gemm``
    passes it, in its order).

    ``output`` (``[M * top_k, N]`` rows, e.g. ``[M, top_k, N]``) is zeroed, then each pair ``p`` that
    ``sorted_token_ids`` holds in a live block (block ``b`` of ``BLOCK_SIZE_M`` entries, before
    ``num_tokens_post_pad[0]``, of expert ``experts_ids[b] >= 0``; entries from the block's start up to its
    first ``p >= M * top_k``) gets ``input[p // top_k] @ W[e].T``, times ``topk_weights.flatten()[p]`` when given,
    with ``W`` as :func:`dequantize_wna16` (rounded to the activations' dtype, as vLLM's Triton WNA16 kernel
    does), accumulated in float32 and rounded once (the kernel adds bf16 partial sums per K block: its own
    rounding differs by a few ulps). Only the first ``min(len, M * BLOCK_SIZE_M * top_k)`` entries are read
    where ``M <= BLOCK_SIZE_M``, as the kernel. Its checks are kept: 4 or 8 bits, bf16/fp16, K a multiple of
    ``BLOCK_SIZE_K``, ``BLOCK_SIZE_K`` a multiple of the group, ``BLOCK_SIZE_M <= 64``; the kernel's limit of 1, 2, 4
    or 8 groups a block is counted (:data:`KERNEL_REFUSES`), not enforced. ``BLOCK_SIZE_N`` only
    tiles the kernel's work. Writes ``output`` in place (the kernel also returns it; vLLM's wrapper drops it).
    """
    CALLS["moe_wna16_gemm"] += 1
    size_m, size_k = input.shape
    size_n = b_qweight.shape[1]
    group = size_k // b_scales.shape[2]
    if bit not in (4, 8):
        raise ValueError(f"moe_wna16_gemm stand-in: bit must be 4 or 8, not {bit}")
    if input.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"moe_wna16_gemm stand-in: only bfloat16 and float16, not {input.dtype}")
    if size_k % BLOCK_SIZE_K or BLOCK_SIZE_K % group:
        raise ValueError(f"moe_wna16_gemm stand-in: K {size_k}, BLOCK_SIZE_K {BLOCK_SIZE_K}, group {group}: "
                         "K must be a multiple of BLOCK_SIZE_K, which must be a multiple of the group")  # fmt: skip
    if BLOCK_SIZE_K // group not in (1, 2, 4, 8):  # the compiled kernel refuses it (KERNEL_REFUSES)
        CALLS[KERNEL_REFUSES] += 1
    if BLOCK_SIZE_M > 64:
        raise ValueError(f"moe_wna16_gemm stand-in: BLOCK_SIZE_M {BLOCK_SIZE_M} > 64")
    rows_out = output.view(-1, size_n)  # refuses a non-contiguous output: the kernel writes [pairs, N] rows
    pairs = size_m * top_k
    output.zero_()
    entries = sorted_token_ids.numel()
    if size_m <= BLOCK_SIZE_M:
        entries = min(entries, size_m * BLOCK_SIZE_M * top_k)
    blocks = -(-entries // BLOCK_SIZE_M)
    if blocks == 0:
        return
    device = input.device
    ids = torch.full((blocks * BLOCK_SIZE_M,), pairs, dtype=torch.long, device=device)
    ids[:entries] = sorted_token_ids[:entries].long()
    ids = ids.view(blocks, BLOCK_SIZE_M)
    experts = experts_ids[:blocks].long()
    live = (torch.arange(blocks, device=device) * BLOCK_SIZE_M < num_tokens_post_pad[0]) & (experts >= 0)
    valid = (ids < pairs).long().cumprod(dim=1).bool() & live.unsqueeze(1)  # the kernel stops at a padding id
    ids = torch.where(valid, ids, pairs)  # invalid: the spare row `pairs` below
    rows = (ids // top_k).clamp(max=size_m - 1)
    weights = None
    if topk_weights is not None:
        weights = topk_weights.reshape(-1).float()[ids.clamp(max=pairs - 1)]
    staged = torch.zeros(pairs + 1, size_n, dtype=torch.float32, device=device)
    per_pass = max(1, PASS_BYTES // (size_n * size_k * 4 * 6))
    for first in range(0, blocks, per_pass):
        last = min(blocks, first + per_pass)
        e = experts[first:last].clamp(min=0)
        zeros = b_qzeros[e] if b_qzeros is not None else None
        w = dequantize_wna16(b_qweight[e], b_scales[e], zeros, bit, size_k).to(input.dtype).float()
        y = torch.bmm(input[rows[first:last]].float(), w.transpose(1, 2))  # [blocks, BLOCK_SIZE_M, N]
        if weights is not None:
            y = y * weights[first:last].unsqueeze(-1)
        y = torch.where(valid[first:last].unsqueeze(-1), y, 0.0)
        staged.index_add_(0, ids[first:last].reshape(-1), y.reshape(-1, size_n))  # each pair once; spares add up
    rows_out.copy_(staged[:pairs].to(output.dtype))


def install() -> dict[str, list[str]]:
    """Register :func:`moe_wna16_gemm` as ``torch.ops._moe_C.moe_wna16_gemm`` where no compiled op of that name is
    loaded, and steer vLLM off its Marlin MoE method where Marlin is absent (:func:`steer_away_from_absent_marlin`);
    idempotent. Returns ``{"installed": [...], "kept": [...], "steered": [...]}``."""
    load_vllm_kernels()
    report = empty_report()
    register("_moe_C", "moe_wna16_gemm", moe_wna16_gemm, ("output",), None, report)
    steered = steer_away_from_absent_marlin()
    report["steered"] = ["compressed_tensors_moe.check_moe_marlin_supports_layer"] if steered else []
    return report


def marlin_missing() -> list[str]:
    """The Marlin MoE kernels (:data:`MARLIN_OPS`) no compiled op stands behind, qualified."""
    return [f"{namespace}::{name}" for namespace, name in MARLIN_OPS if not compiled(namespace, name)]


def _no_marlin(layer, group_size: int) -> bool:
    """The GPU kit has no Marlin kernels: no layer is served by vLLM's Marlin MoE method."""
    return False


def steer_away_from_absent_marlin() -> bool:
    """Where any Marlin MoE kernel is absent (:func:`marlin_missing`), make vLLM 0.16's compressed-tensors MoE
    choice (``compressed_tensors_moe.check_moe_marlin_supports_layer``) answer False, so that W4A16/W8A16
    experts get ``CompressedTensorsWNA16MoEMethod`` (vLLM's Triton WNA16 kernels); with every Marlin kernel
    present, nothing changes. Returns whether vLLM is steered now. Idempotent."""
    load_vllm_kernels()
    if not marlin_missing():
        return False
    from vllm.model_executor.layers.quantization.compressed_tensors import (  # noqa: PLC0415 - vLLM, test kit only
        compressed_tensors_moe,
    )

    compressed_tensors_moe.check_moe_marlin_supports_layer = _no_marlin
    return True
