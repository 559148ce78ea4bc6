"""The torch stand-ins for MLA's prefill with earlier context (chunked prefill) on the GPU kit, against plain loops.

:mod:`speculators_v016.testing.mla_ops` stands in for ``gather_and_maybe_dequant_cache`` (a context chunk's
cache rows into the workspace) and ``merge_attn_states`` (two partial attentions merged by their
log-sum-exps). Each is checked on the CPU against a loop, laid out as vLLM 0.16's MLA metadata builder lays
a batch out (several prefills, some without context, scattered blocks, chunks starting past position 0,
padding), and called through vLLM's own wrappers (``vllm._custom_ops``); a merge of partial attentions
equals attention over all keys at once. The concatenation into the cache and the FA2 stand-in are checked
in ``tests/engine/test_moe_ops.py``.
"""

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

from speculators_v016.testing import mla_ops

WIDTH = 576  # kv_lora_rank 512 + rope 64: the latent row vLLM's gather kernel takes
BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def installed():
    """The stand-ins set once for the module (idempotent)."""
    return mla_ops.install()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chunked_context(context_lens: list[int], chunk: int) -> dict:
    """What vLLM 0.16's MLA metadata builder hands the gather for prefills with ``context_lens`` and a context chunk
    of ``chunk`` tokens (a multiple of the block size): per chunk, cu_seq_lens, token_to_seq (zero-padded to the
    largest chunk), seq_starts, the chunk's rows (a CPU tensor, as its ``chunk_total_token``)."""
    chunks = -(-max(context_lens) // chunk)
    lens = [[max(0, min(n, (i + 1) * chunk) - i * chunk) for n in context_lens] for i in range(chunks)]
    width = max(sum(row) for row in lens)
    out = []
    for i, row in enumerate(lens):
        cu = [0]
        for n in row:
            cu.append(cu[-1] + n)
        owners = [b for b, n in enumerate(row) for _ in range(n)]
        out.append(
            dict(
                cu_seq_lens=torch.tensor(cu, dtype=torch.int32),
                token_to_seq=torch.tensor(owners + [0] * (width - len(owners)), dtype=torch.int32),
                seq_starts=torch.full((len(row),), i * chunk, dtype=torch.int32),
                num_tokens=torch.tensor(cu[-1], dtype=torch.int32),
                lens=row,
                start=i * chunk,
            )
        )
    return out


def scattered_block_table(context_lens: list[int], blocks: int, seed: int) -> torch.Tensor:
    """Each sequence's blocks drawn without repeats from 1..blocks-1 (block 0 is vLLM's null block), rows
    zero-padded to the longest."""
    need = [-(-n // BLOCK) for n in context_lens]
    pool = (torch.randperm(blocks - 1, generator=gen(seed)) + 1).tolist()
    table = torch.zeros(len(context_lens), max(need) + 2, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    return table


def loop_gather(cache, table, context) -> dict[int, torch.Tensor]:
    """Row by row of the chunk: {workspace row: the cache row of its sequence's position}."""
    rows = {}
    for b, n in enumerate(context["lens"]):
        for j in range(n):
            position = context["start"] + j
            rows[int(context["cu_seq_lens"][b]) + j] = cache[table[b, position // BLOCK], position % BLOCK]
    return rows


@pytest.mark.parametrize(
    "context_lens,chunk",
    [([37, 0, 70, 5], 32), ([200], 64), ([1, 16, 17], 16)],
    ids=["three-chunks-one-prefill-without-context", "one-long-context", "block-edges"],
)
def test_gather_matches_a_loop_chunk_by_chunk(context_lens, chunk):
    """Each context chunk (vLLM's wrapper, vLLM's layout): its rows gathered through scattered blocks, the rest kept."""
    blocks = 40
    cache = torch.randn(blocks, BLOCK, WIDTH, generator=gen(1)).to(torch.bfloat16)
    table = scattered_block_table(context_lens, blocks, seed=2)
    for context in chunked_context(context_lens, chunk):
        workspace = torch.full((300, WIDTH), 7.0, dtype=torch.bfloat16)
        ops.gather_and_maybe_dequant_cache(cache, workspace, table, context["cu_seq_lens"], context["token_to_seq"],
                                           context["num_tokens"], "auto", torch.tensor(1.0),
                                           seq_starts=context["seq_starts"])  # fmt: skip
        want = loop_gather(cache, table, context)
        assert len(want) == int(context["num_tokens"])
        for row, value in want.items():
            assert torch.equal(workspace[row], value), (context["start"], row)
        assert (workspace[len(want) :] == 7.0).all()  # past the chunk: untouched


def test_gather_without_seq_starts_reads_from_position_0():
    """No seq_starts (the kernel's optional argument): every sequence's rows from its position 0."""
    cache = torch.randn(10, BLOCK, WIDTH, generator=gen(3)).to(torch.bfloat16)
    table = scattered_block_table([20, 9], 10, seed=4)
    context = chunked_context([20, 9], 32)[0]
    workspace = torch.zeros(40, WIDTH, dtype=torch.bfloat16)
    mla_ops.gather_and_maybe_dequant_cache(cache, workspace, table, context["cu_seq_lens"], context["token_to_seq"],
                                           29, "auto", torch.tensor(1.0))  # fmt: skip
    for row, value in loop_gather(cache, table, context).items():
        assert torch.equal(workspace[row], value)


def test_gather_leaves_rows_past_their_sequence_end():
    """A row whose owner's segment ended (the kernel's guard) is not written, nor any row past num_tokens."""
    cache = torch.randn(6, BLOCK, WIDTH, generator=gen(5)).to(torch.bfloat16)
    table = torch.tensor([[3, 5]], dtype=torch.int32)
    workspace = torch.zeros(8, WIDTH, dtype=torch.bfloat16)
    cu, owners = torch.tensor([0, 4], dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    mla_ops.gather_and_maybe_dequant_cache(cache, workspace, table, cu, owners, 6, "auto", torch.tensor(1.0))
    assert all(torch.equal(workspace[t], cache[3, t]) for t in range(4))
    assert (workspace[4:] == 0).all()


def test_vllms_triton_mla_refuses_an_fp8_cache_and_so_do_the_stand_ins():
    """TRITON_MLA takes no FP8 KV cache (vLLM's own validation); the stand-ins refuse one by name, not silently."""
    assert not TritonMLABackend.supports_kv_cache_dtype("fp8")
    reasons = TritonMLABackend.validate_configuration(
        head_size=WIDTH, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=BLOCK, use_mla=True, has_sink=False,
        use_sparse=False, use_mm_prefix=False, device_capability=DeviceCapability(9, 0), attn_type="decoder",
    )  # fmt: skip
    assert reasons == ["kv_cache_dtype not supported"]
    cache = torch.zeros(2, BLOCK, WIDTH, dtype=torch.uint8)
    index = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="TritonMLA V1 with FP8 KV cache not yet supported"):
        mla_ops.gather_and_maybe_dequant_cache(cache, torch.zeros(2, WIDTH), index.view(1, 2), index, index, 1, "fp8",
                                               torch.tensor(1.0))  # fmt: skip
    with pytest.raises(NotImplementedError, match="fp8_e4m3.*TritonMLA V1 with FP8"):
        mla_ops.concat_and_cache_mla(torch.zeros(1, 512), torch.zeros(1, 64), cache, index[:1], "fp8_e4m3",
                                     torch.tensor(1.0))  # fmt: skip


def test_gather_refuses_what_vllms_kernel_refuses():
    """int64 indices and a row width other than 320/576 are refused by name, as the kernel's checks do."""
    cache = torch.zeros(2, BLOCK, WIDTH)
    index = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table must be int32"):
        mla_ops.gather_and_maybe_dequant_cache(cache, torch.zeros(2, WIDTH), index.view(1, 2).long(), index, index, 1,
                                               "auto", torch.tensor(1.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"widths \(320, 576\)"):
        mla_ops.gather_and_maybe_dequant_cache(torch.zeros(2, BLOCK, 64), torch.zeros(2, 64), index.view(1, 2), index,
                                               index, 1, "auto", torch.tensor(1.0))  # fmt: skip


# -- merge_attn_states ---------------------------------------------------------------------------


def attention_with_lse(q, k, v, scale):
    """[tokens, heads, dv] and lse [heads, tokens] over all keys (float64); no key: output 0, lse +inf (FA2)."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64), torch.full(
            (q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64
        )
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v.double()), lse


def loop_merge(p_out, p_lse, s_out, s_lse):
    """Token by token, head by head, the merge formula in float64 (+inf counts as -inf; both empty: the prefix)."""
    out, lse = torch.empty_like(p_out, dtype=torch.float64), torch.empty_like(p_lse, dtype=torch.float64)
    for t in range(p_out.shape[0]):
        for h in range(p_out.shape[1]):
            a, b = (float("-inf") if x == float("inf") else x for x in (p_lse[h, t].item(), s_lse[h, t].item()))
            top = max(a, b)
            if top == float("-inf"):
                out[t, h], lse[h, t] = p_out[t, h].double(), top
                continue
            wa, wb = torch.exp(torch.tensor(a - top)), torch.exp(torch.tensor(b - top))
            out[t, h] = (p_out[t, h].double() * wa + s_out[t, h].double() * wb) / (wa + wb)
            lse[h, t] = torch.log(wa + wb) + top
    return out, lse


def test_merging_two_partial_attentions_gives_attention_over_all_keys():
    """Through vLLM's wrapper: attention over keys 0..9 merged with keys 10..24 equals attention over 0..24."""
    g = gen(6)
    q, k, v = (torch.randn(n, 4, 16, generator=g) for n in (7, 25, 25))
    full, full_lse = attention_with_lse(q, k, v, 0.3)
    p_out, p_lse = attention_with_lse(q, k[:10], v[:10], 0.3)
    s_out, s_lse = attention_with_lse(q, k[10:], v[10:], 0.3)
    output, output_lse = torch.empty(7, 4, 16), torch.empty(4, 7)
    ops.merge_attn_states(output, p_out.float(), p_lse.float(), s_out.float(), s_lse.float(), output_lse)
    torch.testing.assert_close(output.double(), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(output_lse.double(), full_lse, rtol=1e-6, atol=1e-6)


def test_merge_matches_a_loop_with_empty_sides_in_bf16():
    """bf16, FA2's +inf for "no key" on either side, both sides empty (the prefix, lse -inf), no output lse."""
    g = gen(7)
    p_out, s_out = (torch.randn(5, 2, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    p_lse, s_lse = torch.randn(2, 5, generator=g) * 3, torch.randn(2, 5, generator=g) * 3
    p_lse[:, 1] = float("inf")  # the prefix saw no key: the suffix alone
    p_out[1] = 0
    s_lse[0, 2] = float("inf")  # the suffix saw no key on head 0
    p_lse[1, 3] = s_lse[1, 3] = float("inf")  # neither side saw a key
    output, output_lse = torch.empty(5, 2, 16, dtype=torch.bfloat16), torch.empty(2, 5)
    mla_ops.merge_attn_states(output, output_lse, p_out, p_lse, s_out, s_lse)
    want, want_lse = loop_merge(p_out, p_lse, s_out, s_lse)
    torch.testing.assert_close(output.double(), want, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(output_lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(output[1], s_out[1]) and torch.equal(output[3, 1], p_out[3, 1])
    assert output_lse[1, 3] == float("-inf") and not output.isnan().any()
    again = torch.empty_like(output)
    mla_ops.merge_attn_states(again, None, p_out, p_lse, s_out, s_lse)
    assert torch.equal(again, output)


def test_merge_takes_padded_views_as_forward_mha_passes_them():
    """v padded to the q/k head size, outputs sliced back ([..., :v_dim], same strides both sides): as contiguous."""
    g = gen(8)
    padded_p, padded_s = torch.randn(6, 2, 24, generator=g), torch.randn(6, 2, 24, generator=g)
    p_lse, s_lse = torch.randn(2, 6, generator=g), torch.randn(2, 6, generator=g)
    output, contiguous = torch.empty(6, 2, 16), torch.empty(6, 2, 16)
    ops.merge_attn_states(output, padded_p[..., :16], p_lse, padded_s[..., :16], s_lse)
    ops.merge_attn_states(contiguous, padded_p[..., :16].contiguous(), p_lse, padded_s[..., :16].contiguous(), s_lse)
    assert torch.equal(output, contiguous)
    with pytest.raises(NotImplementedError, match="strides"):
        ops.merge_attn_states(output, padded_p[..., :16], p_lse, padded_s[..., :16].contiguous(), s_lse)


def test_merge_refuses_head_sizes_and_dtypes_the_kernel_refuses():
    """A head size that is not whole 16-byte packs (vLLM routes those to Triton) and fp8 outputs are refused."""
    lse = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="head size 12 is not a multiple of 8"):
        mla_ops.merge_attn_states(torch.empty(2, 1, 12, dtype=torch.bfloat16), None,
                                  *(torch.zeros(2, 1, 12, dtype=torch.bfloat16), lse) * 2)  # fmt: skip
    with pytest.raises(ValueError, match="unsupported data type"):
        fp8 = torch.zeros(2, 1, 16).to(torch.float8_e4m3fn)
        mla_ops.merge_attn_states(fp8, None, fp8, lse, fp8, lse)


def test_install_sets_every_mla_stand_in(installed):
    """The four ops MLA's TRITON_MLA path reaches are set where vLLM's CPU build has none; calls are counted."""
    assert installed == {"installed": ["_C_cache_ops::concat_and_cache_mla", "_vllm_fa2_C::varlen_fwd",
                                       "_C_cache_ops::gather_and_maybe_dequant_cache", "_C::merge_attn_states"],
                         "kept": []}  # fmt: skip
    assert mla_ops.install() == installed
    before = mla_ops.CALLS["gather_and_maybe_dequant_cache"]
    index = torch.zeros(1, dtype=torch.int32)
    torch.ops._C_cache_ops.gather_and_maybe_dequant_cache(torch.zeros(1, BLOCK, WIDTH), torch.zeros(1, WIDTH),
                                                          index.view(1, 1), torch.zeros(2, dtype=torch.int32), index,
                                                          0, "auto", torch.tensor(1.0))  # fmt: skip
    assert mla_ops.CALLS["gather_and_maybe_dequant_cache"] == before + 1
