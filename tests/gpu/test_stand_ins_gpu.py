"""The GPU kit's stand-ins for MLA's context path, INT4 experts and the activations, on the GPU: against vLLM's own
Triton kernels where vLLM has one, and without a host synchronization (they run beside or inside CUDA graphs).

:mod:`speculators_v016.testing.mla_ops` (``gather_and_maybe_dequant_cache``, ``merge_attn_states``),
:mod:`~speculators_v016.testing.wna16_ops` (``moe_wna16_gemm``) and :mod:`~speculators_v016.testing.act_ops`
are checked against loops on CPU in ``tests/engine``; here, on CUDA tensors: the merge reached through vLLM's own
dispatcher (its CUDA route: the stand-in) equals vLLM's Triton merge kernel on padded views as MLA passes them;
vLLM's fused MoE with W4A16 experts (Kimi-K2.5's format) gives the same through the stand-in (its CUDA branch,
decode-sized) as through vLLM's Triton ``fused_moe_kernel_gptq_awq``, and both that of the dequantized weights;
each stand-in runs under ``torch.cuda.set_sync_debug_mode("error")``. No engine: seconds. Skips without CUDA or
where vLLM's CUDA platform does not load.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from helpers.gpu import save_figures, vllm_on_cuda
from speculators_v016.checks.fidelity import row_errors
from speculators_v016.testing import act_ops, mla_ops, moe_ops, wna16_ops

SKIP = vllm_on_cuda()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
GROUP = 32


@pytest.fixture(scope="module", autouse=True)
def stand_ins():
    """The torch stand-ins registered in this process (and vLLM steered off the absent Marlin)."""
    return {"moe": moe_ops.install(), "act": act_ops.install(), "mla": mla_ops.install(), "wna16": wna16_ops.install()}


@contextmanager
def no_host_sync():
    """Any synchronizing CUDA call inside raises (the stand-ins must be capturable in CUDA graphs)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def test_merge_equals_vllms_triton_merge_kernel(stand_ins):
    """MLA's final merge (v sliced out of padded outputs, FA2's +inf where a token saw no context) through vLLM's
    dispatcher, i.e. the stand-in, equals vLLM's Triton merge kernel; no host synchronization."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states  # noqa: PLC0415 - vLLM: GPU host only
    from vllm.v1.attention.ops.triton_merge_attn_states import (  # noqa: PLC0415 - vLLM: GPU host only
        merge_attn_states as triton_merge_attn_states,
    )

    g = cuda_gen(0)
    tokens, heads, padded, v = 300, 8, 192, 128
    prefix, suffix = (torch.randn(tokens, heads, padded, device="cuda", generator=g).to(torch.bfloat16) for _ in "ps")
    prefix_lse, suffix_lse = (torch.randn(heads, tokens, device="cuda", generator=g) * 4 for _ in "ps")
    prefix_lse[:, :7] = float("inf")  # no context for these tokens (a prefill without earlier positions)
    prefix[:7] = 0
    ours, theirs = (torch.empty(tokens, heads, v, dtype=torch.bfloat16, device="cuda") for _ in "ot")
    ours_lse, theirs_lse = (torch.empty(heads, tokens, device="cuda") for _ in "ot")
    calls = mla_ops.CALLS["merge_attn_states"]
    with no_host_sync():
        merge_attn_states(ours, prefix[..., :v], prefix_lse, suffix[..., :v], suffix_lse, ours_lse)
    assert mla_ops.CALLS["merge_attn_states"] == calls + 1  # vLLM's CUDA route: the stand-in
    triton_merge_attn_states(theirs, prefix[..., :v], prefix_lse, suffix[..., :v], suffix_lse, theirs_lse)
    rows = row_errors(ours.flatten(1), theirs.flatten(1))
    lse = (ours_lse - theirs_lse).abs().max().item()
    save_figures("stand-ins-merge-vs-triton", {"rows_max": rows.max().item(), "lse_max_abs": lse})
    assert torch.equal(ours[:7], suffix[:7, :, :v])
    assert rows.max() <= 1e-2 and lse <= 1e-4


def test_gather_on_the_gpu(stand_ins):
    """A context chunk gathered on the GPU (vLLM's layout, the chunk's row count a host tensor): equals indexing;
    no host synchronization."""
    from vllm import _custom_ops as ops  # noqa: PLC0415 - vLLM: GPU host only

    g = cuda_gen(1)
    cache = torch.randn(64, 16, 576, device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randperm(63, device="cuda", generator=g)[:40].view(2, 20).int() + 1
    context, start, size = [200, 90], 64, 64  # the second 64-token chunk of contexts of 200 and 90 tokens
    chunk = [max(0, min(n, start + size) - start) for n in context]  # 64 and 26 rows
    cu = torch.tensor([0, chunk[0], sum(chunk)], dtype=torch.int32, device="cuda")
    owners = torch.tensor([0] * chunk[0] + [1] * chunk[1] + [0] * 38, dtype=torch.int32, device="cuda")
    starts = torch.full((2,), start, dtype=torch.int32, device="cuda")
    workspace = torch.zeros(256, 576, dtype=torch.bfloat16, device="cuda")
    rows, scale = torch.tensor(sum(chunk), dtype=torch.int32), torch.ones(1, device="cuda")  # rows: a host value
    with no_host_sync():
        ops.gather_and_maybe_dequant_cache(cache, workspace, table, cu, owners, rows, "auto", scale, seq_starts=starts)
    positions = [start + torch.arange(n, device="cuda") for n in chunk]
    want = torch.cat([cache[table[b, p // 16].long(), p % 16] for b, p in enumerate(positions)])
    assert torch.equal(workspace[: sum(chunk)], want) and (workspace[sum(chunk) :] == 0).all()


def int4_experts(experts: int, n: int, k: int, seed: int):
    """Codes (value + 8) packed two a byte along K, even k low ([E, N, K/2] as vLLM holds them after loading),
    their group-32 scales [E, N, K/32], and the dequantized weights."""
    g = cuda_gen(seed)
    codes = torch.randint(0, 16, (experts, n, k), device="cuda", generator=g)
    scales = (torch.rand(experts, n, k // GROUP, device="cuda", generator=g) * 0.02 + 0.01).to(torch.bfloat16)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    weights = (codes.float() - 8) * scales.float().repeat_interleave(GROUP, -1)
    return packed, scales, weights


def test_int4_experts_stand_in_equals_vllms_triton_wna16_kernel(stand_ins, monkeypatch):
    """vLLM's fused_experts, W4A16 group 32, 6 tokens x top-4 of 16 experts (its CUDA branch: the stand-in) equals its
    Triton WNA16 branch and an MoE on the dequantized weights; the stand-in alone under no host synchronization."""
    from vllm import _custom_ops as ops  # noqa: PLC0415 - vLLM: GPU host only
    from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415 - vLLM: GPU host only
    from vllm.model_executor.layers.fused_moe import fused_moe as fused_moe_module  # noqa: PLC0415 - GPU host only
    from vllm.model_executor.layers.fused_moe.config import int4_w4a16_moe_quant_config  # noqa: PLC0415 - the same

    experts, inter, hidden, tokens, topk = 16, 128, 256, 6, 4
    w1, s1, d1 = int4_experts(experts, 2 * inter, hidden, seed=2)
    w2, s2, d2 = int4_experts(experts, hidden, inter, seed=3)
    g = cuda_gen(4)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:topk] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, topk, device="cuda", generator=g)
    config = int4_w4a16_moe_quant_config(w1_scale=s1, w2_scale=s2, w1_zp=None, w2_zp=None, block_shape=[0, GROUP])
    calls = []
    real = ops.moe_wna16_gemm
    monkeypatch.setattr(ops, "moe_wna16_gemm", lambda *args: calls.append(args[-1]) or real(*args))
    with set_current_vllm_config(VllmConfig()):
        ours = fused_moe_module.fused_experts(x, w1, w2, weights, ids, quant_config=config)
        assert calls == [4, 4]  # both GEMMs through the stand-in
        monkeypatch.setattr(fused_moe_module, "should_moe_wna16_use_cuda", lambda *args, **kwargs: False)
        theirs = fused_moe_module.fused_experts(x, w1, w2, weights, ids, quant_config=config)
        assert calls == [4, 4]  # vLLM's Triton WNA16 kernel this time
    want = torch.zeros(tokens, hidden, device="cuda")
    for j in range(topk):
        h = torch.einsum("th,tnh->tn", x.float(), d1[ids[:, j].long()])
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        want += weights[:, j : j + 1] * torch.einsum("tn,thn->th", act, d2[ids[:, j].long()])
    figures = {"ours_vs_triton": row_errors(ours, theirs).max().item(),
               "ours_vs_dequantized": row_errors(ours, want).max().item(),
               "triton_vs_dequantized": row_errors(theirs, want).max().item()}  # fmt: skip
    save_figures("stand-ins-wna16-vs-triton", figures)
    assert figures["ours_vs_triton"] <= 1.5e-2 and figures["ours_vs_dequantized"] <= 1.5e-2, figures
    out = torch.empty(tokens, topk, 2 * inter, dtype=torch.bfloat16, device="cuda")
    sorted_ids = torch.arange(tokens * topk, dtype=torch.int32, device="cuda")  # one pair a block of 1
    expert_of_block = ids.flatten().int()
    post_pad = torch.full((1,), tokens * topk, dtype=torch.int32, device="cuda")
    with no_host_sync():
        wna16_ops.moe_wna16_gemm(x, out, w1, s1, None, None, sorted_ids, expert_of_block, post_pad, topk, 1, 128,
                                 128, 4)  # fmt: skip
    want1 = torch.einsum("th,tknh->tkn", x.float(), d1[ids.long()])
    assert row_errors(out.flatten(0, 1), want1.flatten(0, 1)).max() <= 1e-2


@pytest.mark.parametrize("name", list(act_ops.OPS))
def test_activation_ops_on_the_gpu(name, stand_ins):
    """Each activation op (by its _C name) on CUDA bf16 equals its formula in float32 within bf16, without syncing."""
    gated = name.endswith("_and_mul") or name == "mul_and_silu"
    x = (torch.randn(33, 256, device="cuda", generator=cuda_gen(5)) * 3).to(torch.bfloat16)
    out = torch.empty(33, 128 if gated else 256, dtype=torch.bfloat16, device="cuda")
    with no_host_sync():
        getattr(torch.ops._C, name)(out, x)
    f, a, b = x.float(), x[:, :128].float(), x[:, 128:].float()
    gelu_tanh = lambda t: torch.nn.functional.gelu(t, approximate="tanh")  # noqa: E731 - one formula a name
    g, u = x[:, 0::2].float().clamp(max=7.0), x[:, 1::2].float().clamp(-7.0, 7.0)
    want = {
        "silu_and_mul": torch.nn.functional.silu(a) * b,
        "mul_and_silu": a * torch.nn.functional.silu(b),
        "gelu_and_mul": torch.nn.functional.gelu(a) * b,
        "gelu_tanh_and_mul": gelu_tanh(a) * b,
        "fatrelu_and_mul": torch.where(a > 0, a, 0.0) * b,
        "swigluoai_and_mul": (u + 1) * g * torch.sigmoid(1.702 * g),
        "gelu_new": gelu_tanh(f),
        "gelu_fast": gelu_tanh(f),
        "gelu_quick": f * torch.sigmoid(1.702 * f),
    }[name]
    torch.testing.assert_close(out.float(), want, rtol=1.6e-2, atol=1e-2)
