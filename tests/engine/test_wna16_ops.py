"""INT4 experts on the GPU kit: the torch ``moe_wna16_gemm`` against a dequantize-then-matmul loop, and vLLM steered
off Marlin only where Marlin is absent.

:mod:`speculators_v016.testing.wna16_ops` stands in for ``_moe_C.moe_wna16_gemm`` (what vLLM 0.16's fused MoE
calls on CUDA for W4A16 experts when tokens x top-k / experts <= 6). Checked here against a loop over the
(token, choice) pairs on weights dequantized from the unpacked codes (4-bit with and without zero points,
8-bit), with vLLM's own alignment layout (padding, experts without tokens, blocks past the end), and as
vLLM's own ``fused_experts`` calls it (its CUDA branch taken on CPU: the platform answers CUDA, and Triton's
two host helpers it reads are given by plain math, Triton having no driver here) against an INT4 MoE on the
dequantized weights. The steering is checked through vLLM's own ``get_moe_method``: Marlin kept where its
kernels are registered, ``CompressedTensorsWNA16MoEMethod`` where they are absent.
"""

import types

import pytest
import torch
from torch.library import _scoped_library
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.fused_moe import fused_moe as fused_moe_module
from vllm.model_executor.layers.fused_moe import moe_align_block_size as align_module
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
    int4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors_moe
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.utils.marlin_utils import check_moe_marlin_supports_layer
from vllm.platforms import current_platform

from speculators_v016.checks.fidelity import row_errors
from speculators_v016.testing import moe_ops, wna16_ops

GROUP = 32
#: per row, ||ours - loop|| / ||loop||: the weights rounded to bf16 (as vLLM's Triton WNA16 kernel) and the result
ROW_TOLERANCE = 1e-2


@pytest.fixture(scope="module", autouse=True)
def installed():
    """The stand-ins registered once for the module (idempotent); vLLM's choice restored after the module."""
    real = compressed_tensors_moe.check_moe_marlin_supports_layer
    yield {"moe": moe_ops.install(), "wna16": wna16_ops.install()}
    compressed_tensors_moe.check_moe_marlin_supports_layer = real


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pack_low_first(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit codes packed two a byte along ``dim``, the even index in the low nibble."""
    last = codes.movedim(dim, -1)
    return (last[..., 0::2] | (last[..., 1::2] << 4)).to(torch.uint8).movedim(-1, dim)


def dequantized(codes, scales, zeros=None, bit=4):
    """The loop's weights from the unpacked codes: (code - zero) * scale, zero 8 (4-bit) or 128 (8-bit) if none."""
    zero = zeros.float() if zeros is not None else torch.full_like(scales, 8.0 if bit == 4 else 128.0)
    return (codes.float() - zero.repeat_interleave(GROUP, -1)) * scales.float().repeat_interleave(GROUP, -1)


def aligned(topk_ids, experts, block):
    """vLLM's alignment (its wrapper, our moe_align_block_size stand-in beneath)."""
    numel = topk_ids.numel()
    size = numel + experts * (block - 1)
    if numel < experts:
        size = min(numel * block, size)
    sorted_ids, expert_ids = torch.empty(size, dtype=torch.int32), torch.empty(-(-size // block), dtype=torch.int32)
    post_pad = torch.empty(1, dtype=torch.int32)
    ops.moe_align_block_size(topk_ids, experts, block, sorted_ids, expert_ids, post_pad, None)
    return sorted_ids, expert_ids, post_pad


def loop_gemm(x, weights, topk_ids, topk_weights):
    """Pair by pair: x[token] @ W[expert].T (times its routing weight), in float64."""
    tokens, topk = topk_ids.shape
    out = torch.zeros(tokens * topk, weights.shape[1], dtype=torch.float64)
    for p in range(tokens * topk):
        t, k = divmod(p, topk)
        out[p] = x[t].double() @ weights[topk_ids[t, k]].double().T
        if topk_weights is not None:
            out[p] *= topk_weights[t, k].double()
    return out


def routing(tokens, topk, experts, seed):
    g = gen(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
    return ids, torch.rand(tokens, topk, generator=g)


@pytest.mark.parametrize(
    "tokens,topk,experts,n,k,block_m,routed",
    [(3, 2, 8, 64, 128, 16, True), (1, 4, 16, 32, 64, 1, False), (12, 2, 4, 64, 256, 16, True)],
    ids=["decode-batch", "one-token-block-1", "more-tokens-than-a-block"],
)
def test_int4_gemm_matches_a_dequantize_then_matmul_loop(tokens, topk, experts, n, k, block_m, routed):
    """4-bit, no zero points (stored code = value + 8): every pair's row, routing weights applied or not."""
    g = gen(tokens + k)
    codes = torch.randint(0, 16, (experts, n, k), generator=g)
    scales = (torch.rand(experts, n, k // GROUP, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    topk_ids, topk_weights = routing(tokens, topk, experts, seed=k)
    sorted_ids, expert_ids, post_pad = aligned(topk_ids, experts, block_m)
    out = torch.full((tokens, topk, n), float("nan"), dtype=torch.bfloat16)
    torch.ops._moe_C.moe_wna16_gemm(x, out, pack_low_first(codes, 2), scales, None,
                                    topk_weights if routed else None, sorted_ids, expert_ids, post_pad, topk,
                                    block_m, 32, min(k, 128), 4)  # fmt: skip
    want = loop_gemm(x, dequantized(codes, scales), topk_ids, topk_weights if routed else None)
    assert row_errors(out.view(-1, n), want).max() < ROW_TOLERANCE


def test_int4_zero_points_and_int8_codes_match_the_loop():
    """4-bit zero points (packed two a byte along N, even n low) and 8-bit codes with and without zero points."""
    tokens, topk, experts, n, k = 4, 2, 4, 32, 64
    g = gen(21)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    topk_ids, topk_weights = routing(tokens, topk, experts, seed=22)
    sorted_ids, expert_ids, post_pad = aligned(topk_ids, experts, 4)
    scales = (torch.rand(experts, n, k // GROUP, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
    cases = {
        "int4-zp": (torch.randint(0, 16, (experts, n, k), generator=g), torch.randint(0, 16, (experts, n, k // GROUP),
                                                                                       generator=g), 4),
        "int8": (torch.randint(0, 256, (experts, n, k), generator=g), None, 8),
        "int8-zp": (torch.randint(0, 256, (experts, n, k), generator=g),
                    torch.randint(100, 156, (experts, n, k // GROUP), generator=g), 8),
    }  # fmt: skip
    for name, (codes, zeros, bit) in cases.items():
        qweight = pack_low_first(codes, 2) if bit == 4 else codes.to(torch.uint8)
        qzeros = None if zeros is None else (pack_low_first(zeros, 1) if bit == 4 else zeros.to(torch.uint8))
        out = torch.empty(tokens, topk, n, dtype=torch.bfloat16)
        torch.ops._moe_C.moe_wna16_gemm(x, out, qweight, scales, qzeros, topk_weights, sorted_ids, expert_ids,
                                        post_pad, topk, 4, 32, 64, bit)  # fmt: skip
        want = loop_gemm(x, dequantized(codes, scales, zeros, bit), topk_ids, topk_weights)
        assert row_errors(out.view(-1, n), want).max() < ROW_TOLERANCE, name


def test_blocks_past_the_end_or_without_an_expert_leave_zeros():
    """Pairs only in blocks past num_tokens_post_pad or of expert -1 are not computed: their rows stay 0 (zeroed)."""
    x = torch.randn(2, 64, generator=gen(30)).to(torch.bfloat16)
    codes = torch.randint(0, 16, (2, 32, 64), generator=gen(31))
    scales = torch.full((2, 32, 2), 0.01, dtype=torch.bfloat16)
    sorted_ids = torch.tensor([0, 2, 1, 2, 2, 2, 2, 2], dtype=torch.int32)  # blocks of 2: pairs 0 | 1 | - | -
    expert_ids = torch.tensor([1, -1, 0, 0], dtype=torch.int32)
    out = torch.full((2, 1, 32), 5.0, dtype=torch.bfloat16)
    torch.ops._moe_C.moe_wna16_gemm(x, out, pack_low_first(codes, 2), scales, None, None, sorted_ids, expert_ids,
                                    torch.tensor([4], dtype=torch.int32), 1, 2, 32, 64, 4)  # fmt: skip
    assert row_errors(out[0], x[:1].double() @ dequantized(codes, scales)[1].double().T).max() < ROW_TOLERANCE
    assert (out[1] == 0).all()


def test_the_kernels_checks_are_kept():
    """K not a multiple of BLOCK_SIZE_K, BLOCK_SIZE_M > 64, 3 bits: refused by name, as the kernel's checks do."""
    x, out = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    args = [
        x,
        out,
        torch.zeros(1, 32, 32, dtype=torch.uint8),
        torch.ones(1, 32, 2, dtype=torch.bfloat16),
        None,
        None,
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        1,
    ]
    for block_m, block_k, bit, what in ((1, 48, 4, "multiple of BLOCK_SIZE_K"), (128, 64, 4, "BLOCK_SIZE_M 128"),
                                        (1, 64, 3, "bit must be 4 or 8")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            wna16_ops.moe_wna16_gemm(*args, block_m, 32, block_k, bit)


def test_vllms_fused_experts_runs_int4_experts_through_the_stand_in(monkeypatch):
    """vLLM's own fused_experts, W4A16 group 32 (Kimi's experts), 5 tokens x top-2 of 8 experts (<= 6 a expert: its
    CUDA WNA16 branch, both GEMMs through the stand-in) within bf16 of an MoE on the dequantized weights."""
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)  # its CUDA branch, on the CPU
    cdiv = lambda a, b: -(-a // b)  # noqa: E731 - Triton's host helper, plain math
    monkeypatch.setattr(fused_moe_module, "tl", types.SimpleNamespace(bfloat16="bf16", float16="fp16", float32="fp32"))
    monkeypatch.setattr(fused_moe_module, "triton", types.SimpleNamespace(cdiv=cdiv))
    monkeypatch.setattr(align_module, "triton", types.SimpleNamespace(cdiv=cdiv))
    calls = []
    real = ops.moe_wna16_gemm
    monkeypatch.setattr(ops, "moe_wna16_gemm", lambda *args: calls.append(args[-1]) or real(*args))
    experts, n, k, tokens, topk = 8, 64, 128, 5, 2
    g = gen(40)
    c1, c2 = torch.randint(0, 16, (experts, 2 * n, k), generator=g), torch.randint(0, 16, (experts, k, n), generator=g)
    s1 = (torch.rand(experts, 2 * n, k // GROUP, generator=g) * 0.02 + 0.01).to(torch.bfloat16)
    s2 = (torch.rand(experts, k, n // GROUP, generator=g) * 0.02 + 0.01).to(torch.bfloat16)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    topk_ids, topk_weights = routing(tokens, topk, experts, seed=41)
    config = int4_w4a16_moe_quant_config(w1_scale=s1, w2_scale=s2, w1_zp=None, w2_zp=None, block_shape=[0, GROUP])
    before = wna16_ops.CALLS["moe_wna16_gemm"]
    with set_current_vllm_config(VllmConfig()):
        out = fused_moe_module.fused_experts(x, pack_low_first(c1, 2), pack_low_first(c2, 2), topk_weights, topk_ids,
                                             quant_config=config)  # fmt: skip
    w1, w2 = dequantized(c1, s1), dequantized(c2, s2)
    want = torch.zeros(tokens, k)
    for t in range(tokens):
        for j in range(topk):
            h = x[t].float() @ w1[topk_ids[t, j]].T
            want[t] += topk_weights[t, j] * ((torch.nn.functional.silu(h[:n]) * h[n:]) @ w2[topk_ids[t, j]].T)
    assert calls == [4, 4]  # both GEMMs, 4-bit, through vLLM's wrapper into the stand-in
    assert wna16_ops.CALLS["moe_wna16_gemm"] == before + 2  # and the stand-in ran them
    assert row_errors(out, want).max() < 1.5e-2


# -- steering off an absent Marlin -------------------------------------------------------------


class FusedMoE(torch.nn.Module):
    """What vLLM's method choice reads of an MoE layer (its class name matches compressed-tensors' FusedMoE target)."""

    def __init__(self):
        super().__init__()
        self.hidden_size, self.intermediate_size_per_partition, self.apply_router_weight_on_input = 256, 128, False
        self.moe_config = FusedMoEConfig(
            num_experts=16, experts_per_token=4, hidden_dim=256, intermediate_size_per_partition=128,
            num_local_experts=16, activation="silu", device="cpu", routing_method=RoutingMethodType.DeepSeekV3,
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
        )  # fmt: skip


#: Kimi-K2.5's expert quantization: compressed-tensors pack-quantized int4, symmetric, group 32, no activations
KIMI_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
                        "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip


def chosen_method() -> str:
    config = CompressedTensorsConfig.from_config(KIMI_W4A16)
    method = compressed_tensors_moe.CompressedTensorsMoEMethod.get_moe_method(
        config, FusedMoE(), "model.layers.1.mlp.experts"
    )
    return type(method).__name__


def test_marlin_kept_where_its_kernels_are_registered_and_steered_away_where_absent(monkeypatch):
    """With both Marlin kernels registered nothing changes (vLLM picks Marlin); one absent: the Triton WNA16 method."""
    monkeypatch.setattr(compressed_tensors_moe, "check_moe_marlin_supports_layer", check_moe_marlin_supports_layer)
    assert chosen_method() == "CompressedTensorsWNA16MarlinMoEMethod"  # Kimi's shapes: vLLM prefers Marlin
    with _scoped_library("_moe_C", "FRAGMENT") as moe_lib, _scoped_library("_C", "FRAGMENT") as c_lib:
        moe_lib.define("moe_wna16_marlin_gemm(Tensor input) -> Tensor")  # a real build's Marlin, simulated
        c_lib.define("gptq_marlin_repack(Tensor b_q_weight) -> Tensor")
        assert wna16_ops.marlin_missing() == []
        assert wna16_ops.steer_away_from_absent_marlin() is False
        assert chosen_method() == "CompressedTensorsWNA16MarlinMoEMethod"
    with _scoped_library("_moe_C", "FRAGMENT") as moe_lib:
        moe_lib.define("moe_wna16_marlin_gemm(Tensor input) -> Tensor")  # the GEMM alone: loading would still fail
        assert wna16_ops.marlin_missing() == ["_C::gptq_marlin_repack"]
        assert wna16_ops.steer_away_from_absent_marlin() is True
        assert chosen_method() == "CompressedTensorsWNA16MoEMethod"
    assert wna16_ops.marlin_missing() == ["_moe_C::moe_wna16_marlin_gemm", "_C::gptq_marlin_repack"]
    assert wna16_ops.steer_away_from_absent_marlin() is True  # idempotent
    assert chosen_method() == "CompressedTensorsWNA16MoEMethod"


def test_install_registers_the_gemm_and_steers_here(installed):
    """On vLLM's CPU build (no _moe_C, no Marlin): the GEMM is ours and vLLM is steered; idempotent."""
    assert installed["wna16"] == {"installed": ["_moe_C::moe_wna16_gemm"], "kept": [],
                                  "steered": ["compressed_tensors_moe.check_moe_marlin_supports_layer"]}  # fmt: skip
    assert wna16_ops.install() == installed["wna16"]


def test_sixteen_groups_a_block_are_computed_and_counted():
    """BLOCK_SIZE_K 16 groups (vLLM's block config at Kimi's K 7168, group 32; the kernel refuses it): computed, counted."""
    tokens, topk, experts, n, k = 2, 2, 4, 32, 16 * GROUP
    g = gen(41)
    codes = torch.randint(0, 16, (experts, n, k), generator=g)
    scales = (torch.rand(experts, n, k // GROUP, generator=g) * 0.02 + 0.005).to(torch.bfloat16)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    topk_ids, topk_weights = routing(tokens, topk, experts, seed=42)
    sorted_ids, expert_ids, post_pad = aligned(topk_ids, experts, 4)
    out = torch.empty(tokens, topk, n, dtype=torch.bfloat16)
    before = wna16_ops.CALLS[wna16_ops.KERNEL_REFUSES]
    wna16_ops.moe_wna16_gemm(x, out, pack_low_first(codes, 2), scales, None, topk_weights, sorted_ids, expert_ids,
                             post_pad, topk, 4, 32, k, 4)  # fmt: skip
    assert wna16_ops.CALLS[wna16_ops.KERNEL_REFUSES] == before + 1
    want = loop_gemm(x, dequantized(codes, scales), topk_ids, topk_weights)
    assert row_errors(out.view(-1, n), want).max() < ROW_TOLERANCE
