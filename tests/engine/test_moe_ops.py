"""The torch stand-ins for vLLM's compiled MoE and MLA kernels (GPU tests only), each against plain loops.

(The activation kernels: ``tests/engine/test_act_ops.py``; MLA's prefill with earlier context:
``tests/engine/test_mla_ops.py``; INT4 experts: ``tests/engine/test_wna16_ops.py``.)

:mod:`speculators_v016.testing.moe_ops` and :mod:`speculators_v016.testing.mla_ops` stand in for
kernels the GPU kit lacks; here each one is checked on the CPU against a loop that spells out what
the kernel computes, with the edge cases the engine meets (fewer tokens than a block, experts
without tokens, padding, skipped cache slots, rows that see no key), and reached through vLLM's
own wrappers (``vllm._custom_ops``, its routers) where vLLM's CPU build has them.
"""

import math

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

from speculators_v016.testing import mla_ops, moe_ops


@pytest.fixture(scope="module", autouse=True)
def installed():
    """The stand-ins registered once for the module (idempotent)."""
    return {**moe_ops.install(), "mla": mla_ops.install()}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- routing ---------------------------------------------------------------------------------


def loop_topk(scores: torch.Tensor, topk: int, renormalize: bool, bias=None, scale: float = 1.0):
    """Per token: the top-k experts by score (+ bias), weighted by the plain score."""
    ids, weights = [], []
    for row in range(scores.shape[0]):
        choice = [scores[row, e].item() + (bias[e].item() if bias is not None else 0.0) for e in range(scores.shape[1])]
        best = sorted(range(len(choice)), key=lambda e: -choice[e])[:topk]
        w = [scores[row, e].item() for e in best]
        total = sum(w) if renormalize else 1.0
        ids.append(best)
        weights.append([x / total * scale for x in w])
    return torch.tensor(ids), torch.tensor(weights)


def run_topk(fn, gating, topk, renormalize, bias=None):
    tokens = gating.shape[0]
    w = torch.empty(tokens, topk, dtype=torch.float32)
    ids = torch.empty(tokens, topk, dtype=torch.int32)
    src = torch.empty(tokens, topk, dtype=torch.int32)
    fn(w, ids, src, gating, renormalize, bias)
    return w, ids, src


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_topk_softmax_matches_a_loop(renormalize, with_bias):
    """topk_softmax (through vLLM's ops name): float32 softmax, top-k by score + bias, plain weights, source rows."""
    gating = torch.randn(37, 8, generator=gen(0)).to(torch.bfloat16)
    bias = torch.randn(8, generator=gen(1)) * 0.1 if with_bias else None
    w, ids, src = run_topk(ops.topk_softmax, gating, 2, renormalize, bias)
    want_ids, want_w = loop_topk(gating.float().softmax(-1), 2, renormalize, bias)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=1e-6, atol=1e-7)
    assert torch.equal(src, torch.tensor([[k * 37 + i for k in range(2)] for i in range(37)], dtype=torch.int32))


def test_topk_sigmoid_matches_a_loop():
    """topk_sigmoid: the same with a sigmoid per expert, bias in the choice only."""
    gating = torch.randn(9, 16, generator=gen(2))
    bias = torch.randn(16, generator=gen(3)) * 0.3
    w, ids, _ = run_topk(ops.topk_sigmoid, gating, 4, True, bias)
    want_ids, want_w = loop_topk(gating.sigmoid(), 4, True, bias)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=1e-6, atol=1e-7)


def test_vllms_fused_topk_router_runs_on_the_stand_in():
    """vLLM's own fused_topk (Mixtral's and Qwen3-MoE's router) returns the loop's routing through the stand-in."""
    gating = torch.randn(20, 4, generator=gen(4))
    w, ids, _ = fused_topk(torch.zeros(20, 8), gating, 2, renormalize=True)
    want_ids, want_w = loop_topk(gating.softmax(-1), 2, True)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=1e-6, atol=1e-7)


def loop_grouped_topk(logits, n_group, topk_group, topk, renormalize, scale, bias, sigmoid=True):
    """DeepSeek-V3's noaux_tc routing, token by token: groups by the sum of their two best biased scores."""
    ids, weights = [], []
    experts = logits.shape[1]
    per = experts // n_group
    for row in range(logits.shape[0]):
        s = [1 / (1 + math.exp(-x)) if sigmoid else x for x in logits[row].double().tolist()]
        b = [s[e] + bias[e].item() for e in range(experts)]
        group_score = [sum(sorted(b[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for e in range(experts) if e // per in groups]
        best = sorted(candidates, key=lambda e: -b[e])[:topk]
        w = [s[e] for e in best]
        total = sum(w) if renormalize else 1.0
        ids.append(best)
        weights.append([x / total * scale for x in w])
    return torch.tensor(ids), torch.tensor(weights)


@pytest.mark.parametrize(
    "experts,n_group,topk_group,topk",
    [(16, 4, 2, 4), (8, 2, 1, 2), (16, 1, 1, 4), (12, 4, 4, 3)],
    ids=["deepseek-like", "one-of-two", "kimi-k2-one-group", "all-groups"],
)
def test_grouped_topk_matches_a_loop(experts, n_group, topk_group, topk):
    """grouped_topk (vLLM's wrapper refuses non-CUDA platforms: the op by its name): sigmoid, biased group choice, unbiased weights, renorm, scale."""
    logits = torch.randn(23, experts, generator=gen(5)).to(torch.bfloat16)
    bias = torch.randn(experts, generator=gen(6)) * 0.2
    w, ids = torch.ops._moe_C.grouped_topk(logits, n_group, topk_group, topk, True, 2.5, bias, 1)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (23, topk)
    want_ids, want_w = loop_grouped_topk(logits.float(), n_group, topk_group, topk, True, 2.5, bias)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=1e-5, atol=1e-6)


def test_grouped_topk_with_scores_given_and_no_renormalization():
    """scoring_func 0 (scores used as given, vLLM's softmax path) and renormalize off."""
    scores = torch.rand(7, 8, generator=gen(7))
    bias = torch.zeros(8)
    w, ids = torch.ops._moe_C.grouped_topk(scores, 2, 1, 2, False, 1.0, bias, 0)
    want_ids, want_w = loop_grouped_topk(scores, 2, 1, 2, False, 1.0, bias, sigmoid=False)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w.float(), rtol=1e-6, atol=1e-7)


def test_grouped_topk_traces_under_torch_compile():
    """vLLM calls grouped_topk inside a torch.compile(dynamic=True) function: the op traces (its fake shapes)."""
    compiled = torch.compile(
        lambda s, b: torch.ops._moe_C.grouped_topk(s, 4, 2, 4, True, 2.5, b, 1), backend="aot_eager", dynamic=True
    )
    bias = torch.randn(16, generator=gen(8))
    for tokens in (5, 11):
        logits = torch.randn(tokens, 16, generator=gen(tokens))
        got, want = compiled(logits, bias), torch.ops._moe_C.grouped_topk(logits, 4, 2, 4, True, 2.5, bias, 1)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


# -- moe_align_block_size ----------------------------------------------------------------------


def align_buffers(numel: int, experts: int, block: int):
    """The buffers vLLM 0.16's moe_align_block_size wrapper allocates (fused_moe/moe_align_block_size.py)."""
    size = numel + experts * (block - 1)
    if numel < experts:
        size = min(numel * block, size)
    return (
        torch.empty(size, dtype=torch.int32),
        torch.empty((size + block - 1) // block, dtype=torch.int32),
        torch.empty(1, dtype=torch.int32),
    )


def loop_align(topk_ids: torch.Tensor, experts: int, block: int, size: int, blocks: int):
    """Expert by expert: its pairs in flattened order, padded with numel to a multiple of the block."""
    flat = topk_ids.flatten().tolist()
    numel = len(flat)
    sorted_ids, expert_of_block = [], []
    for e in range(experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        padded = -(-len(mine) // block) * block
        sorted_ids += mine + [numel] * (padded - len(mine))
        expert_of_block += [e] * (padded // block)
    total = len(sorted_ids)
    return sorted_ids + [numel] * (size - total), expert_of_block + [-1] * (blocks - len(expert_of_block)), total


def run_align(topk_ids, experts, block):
    sorted_ids, expert_ids, post_pad = align_buffers(topk_ids.numel(), experts, block)
    ops.moe_align_block_size(topk_ids, experts, block, sorted_ids, expert_ids, post_pad, None)
    return sorted_ids, expert_ids, post_pad


def test_moe_align_block_size_documented_example():
    """vLLM's docstring example (experts renumbered from 0): [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]."""
    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32) - 1
    sorted_ids, expert_ids, post_pad = run_align(topk_ids, 4, 4)
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert expert_ids[:4].tolist() == [0, 1, 2, 3] and post_pad.item() == 16
    assert set(sorted_ids[16:].tolist()) <= {12} and set(expert_ids[4:].tolist()) <= {-1}


@pytest.mark.parametrize(
    "tokens,topk,experts,block",
    [(1, 2, 8, 16), (3, 4, 16, 16), (37, 2, 4, 16), (200, 4, 16, 64), (5, 1, 64, 32), (64, 2, 8, 1)],
    ids=["one-token", "fewer-than-a-block", "mixtral-like", "deepseek-like", "numel-below-experts", "block-1"],
)
def test_moe_align_block_size_matches_a_loop(tokens, topk, experts, block):
    """Segments per expert in order, padded with numel, empty experts take no block, the rest -1 / numel."""
    g = gen(tokens * 31 + experts)
    topk_ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
    sorted_ids, expert_ids, post_pad = run_align(topk_ids, experts, block)
    want_sorted, want_experts, total = loop_align(topk_ids, experts, block, sorted_ids.numel(), expert_ids.numel())
    assert post_pad.item() == total and total % block == 0
    assert sorted_ids.tolist() == want_sorted
    assert expert_ids.tolist() == want_experts


def test_moe_align_block_size_skips_ids_past_the_experts():
    """Ids >= num_experts are left out (not counted, not placed), as the kernel does."""
    topk_ids = torch.tensor([[0, 5], [1, 0]], dtype=torch.int32)
    sorted_ids, expert_ids, post_pad = run_align(topk_ids, 2, 4)
    assert post_pad.item() == 8
    assert sorted_ids[:8].tolist() == [0, 3, 4, 4, 2, 4, 4, 4] and expert_ids[:2].tolist() == [0, 1]


def test_moe_align_block_size_layout_feeds_a_grouped_gemm():
    """Consumed as vLLM's Triton GEMM does (blocks up to num_tokens_post_pad, ids < numel): every pair once, right."""
    tokens, topk, experts, block, hidden = 29, 2, 8, 16, 6
    g = gen(9)
    topk_ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
    x, w = torch.randn(tokens, hidden, generator=g), torch.randn(experts, hidden, 3, generator=g)
    sorted_ids, expert_ids, post_pad = run_align(topk_ids, experts, block)
    out = torch.full((tokens * topk, 3), float("nan"))
    for b in range(post_pad.item() // block):
        for pair in sorted_ids[b * block : (b + 1) * block].tolist():
            if pair < tokens * topk:
                out[pair] = x[pair // topk] @ w[expert_ids[b]]
    want = torch.stack([x[p // topk] @ w[topk_ids.flatten()[p]] for p in range(tokens * topk)])
    torch.testing.assert_close(out, want)


def test_moe_align_block_size_refuses_an_expert_map():
    """Expert parallelism (an expert map) is not stood in: refused by name, not silently mis-laid."""
    sorted_ids, expert_ids, post_pad = align_buffers(4, 4, 4)
    with pytest.raises(NotImplementedError, match="expert_map"):
        moe_ops.moe_align_block_size(torch.zeros(2, 2, dtype=torch.int32), 4, 4, sorted_ids, expert_ids, post_pad,
                                     torch.arange(4))  # fmt: skip


# -- moe_sum, install ---------------------------------------------------------------------------


@pytest.mark.parametrize("topk", [1, 2, 4])
def test_moe_sum_matches_a_loop(topk):
    """moe_sum (through vLLM's ops name): [tokens, topk, hidden] summed over the choices into output."""
    x = torch.randn(11, topk, 8, generator=gen(10)).to(torch.bfloat16)
    out = torch.empty(11, 8, dtype=torch.bfloat16)
    ops.moe_sum(x, out)
    want = torch.stack([sum(x[t, k].float() for k in range(topk)) for t in range(11)])
    torch.testing.assert_close(out.float(), want, rtol=8e-3, atol=1e-2)


def test_install_keeps_compiled_kernels(installed):
    """A compiled op of the same name stays (vLLM's CPU build has _C.silu_and_mul); the missing ones are ours, the
    activations the fused MoE calls included (act_ops)."""
    assert installed["kept"] == ["_C::silu_and_mul", "_C::gelu_and_mul", "_C::gelu_tanh_and_mul", "_C::gelu_new",
                                 "_C::gelu_fast", "_C::gelu_quick"]  # fmt: skip
    assert set(installed["installed"]) == {f"_moe_C::{n}" for n in
                                           ("topk_softmax", "topk_sigmoid", "grouped_topk", "moe_align_block_size",
                                            "moe_sum")} | {"_C::mul_and_silu", "_C::fatrelu_and_mul",
                                                           "_C::swigluoai_and_mul"}  # fmt: skip
    assert moe_ops.install() == {k: v for k, v in installed.items() if k != "mla"}  # idempotent
    assert installed["mla"]["installed"][:2] == ["_C_cache_ops::concat_and_cache_mla", "_vllm_fa2_C::varlen_fwd"]


# -- MLA -------------------------------------------------------------------------------------


def test_concat_and_cache_mla_matches_a_loop():
    """concat_and_cache_mla (through vLLM's ops name): [kv_c | k_pe] at each slot; negative slots skipped."""
    blocks, block, rank, rope = 4, 16, 12, 4
    cache = torch.randn(blocks, block, rank + rope, generator=gen(12)).to(torch.bfloat16)
    before = cache.clone()
    kv_c = torch.randn(6, rank, generator=gen(13)).to(torch.bfloat16)
    k_pe = torch.randn(6, rope, generator=gen(14)).to(torch.bfloat16)
    slots = torch.tensor([17, 18, -1, 63, 32, -1, 5, 5])  # padded past the tokens, as vLLM's slot mapping may be
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, kv_cache_dtype="auto", scale=torch.tensor(1.0))
    want = before.clone()
    for i, s in enumerate(slots[:6].tolist()):
        if s >= 0:
            want[s // block, s % block] = torch.cat([kv_c[i], k_pe[i]])
    assert torch.equal(cache, want)


def loop_attention(q, k, v, cu_q, cu_k, scale, causal):
    """Sequence by sequence, query by query, in float64: softmax over the keys it sees."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(lq):
            keys = [j for j in range(lk) if not causal or j <= i + lk - lq]
            if not keys:
                continue
            for h in range(q.shape[1]):
                qi = q[cu_q[b] + i, h].double()
                s = torch.stack([qi @ k[cu_k[b] + j, h // group].double() * scale for j in keys])
                lse[h, cu_q[b] + i] = torch.logsumexp(s, 0)
                p = torch.softmax(s, 0)
                out[cu_q[b] + i, h] = sum(p[n] * v[cu_k[b] + j, h // group].double() for n, j in enumerate(keys))
    return out, lse


@pytest.mark.parametrize("causal,lengths_k", [(True, None), (False, [2, 9, 1]), (True, [5, 12, 0])],
                         ids=["causal-self", "context-chunk", "bottom-right"])  # fmt: skip
def test_varlen_fwd_matches_a_loop(causal, lengths_k):
    """varlen_fwd, called as flash_attn_varlen_func calls FA2: per-sequence softmax, lse, +inf where nothing is seen."""
    lengths_q = [3, 7, 1]
    lengths_k = lengths_k or lengths_q
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    g = gen(15)
    q = torch.randn(int(cu_q[-1]), 4, 6, generator=g).to(torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), 2, 6, generator=g).to(torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), 2, 6, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    got, lse = torch.ops._vllm_fa2_C.varlen_fwd(q, k, v, out, cu_q, cu_k, None, None, None, None, max(lengths_q),
                                                max(lengths_k), 0.0, 0.3, False, causal, -1, -1, 0.0, False, 0,
                                                None)  # fmt: skip
    want, want_lse = loop_attention(q, k, v, cu_q.tolist(), cu_k.tolist(), 0.3, causal)
    assert got is out and lse.dtype == torch.float32 and lse.shape == (4, q.shape[0])
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    if lengths_k == [5, 12, 0]:  # the last sequence has a query and no key
        assert torch.isinf(lse[:, -1]).all() and (got[-1] == 0).all()


def test_varlen_fwd_refuses_what_it_does_not_cover():
    """Paged keys, dropout, soft-capping, sliding windows: refused by name."""
    q = torch.zeros(2, 1, 4)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    base = [q, q, q, None, cu, cu, None, None, None, None, 2, 2, 0.0, 1.0, False, True, -1, -1, 0.0, False, 0, None]
    for index, value, what in ((6, cu, "seqused_k"), (12, 0.1, "dropout"), (18, 5.0, "softcap"), (16, 8, "window")):
        args = list(base)
        args[index] = value
        with pytest.raises(NotImplementedError, match=what):
            mla_ops.varlen_fwd(*args)
