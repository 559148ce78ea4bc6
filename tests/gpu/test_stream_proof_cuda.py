"""The start-up stream proof on CUDA in bf16 and fp16, with a fused add-RMSNorm kernel of the kind vLLM runs.

vLLM cannot be installed on the GPU host, so its CUDA fused add-RMSNorm is stood
in for by one of our own in Triton that does what such kernels do: it loads
``x`` and ``residual``, adds them in float32, stores the rounded sum as the new
residual, and normalizes the float32 sum (reduction order by the kernel's
tiles, not torch's). The stand-in decoder (Llama-like: residual stream =
``hidden_states + residual``) runs on the GPU in the engine's dtype with
arguments of very different scales; the proof must establish the sum, with
the right candidate within its dtype's tolerance, and refuse a norm that reads
``x + 2 * residual``. Skips without CUDA (and without Triton).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from speculators_v016.worker.aux_outputs import install_aux_outputs
from speculators_v016.worker.stream_proof import CheckForward, StreamProofError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _add_rms_norm(x, residual, weight, out, hidden, eps, factor, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < hidden
        a = tl.load(x + row * hidden + offsets, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(residual + row * hidden + offsets, mask=inside, other=0.0).to(tl.float32)
        total = a + factor * r
        tl.store(residual + row * hidden + offsets, total.to(residual.dtype.element_ty), mask=inside)
        variance = tl.sum(total * total, axis=0) / hidden
        w = tl.load(weight + offsets, mask=inside, other=0.0).to(tl.float32)
        normed = total * tl.math.rsqrt(variance + eps) * w
        tl.store(out + row * hidden + offsets, normed.to(out.dtype.element_ty), mask=inside)


HIDDEN, TOKENS = 1024, 13


class FusedAddRMSNorm(nn.Module):
    """In place, as vLLM's: residual <- x + residual (rounded), returns (norm(x + residual), residual)."""

    def __init__(self, factor: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.factor = factor

    def forward(self, x, residual=None):
        if residual is None:  # the first layer's norm: no residual yet
            out, _ = self.forward(x, torch.zeros_like(x))
            return out
        out = torch.empty_like(x)
        _add_rms_norm[(x.shape[0],)](x, residual, self.weight, out, HIDDEN, 1e-6, self.factor,
                                     BLOCK=triton.next_power_of_2(HIDDEN))  # fmt: skip
        return out, residual


class Layer(nn.Module):
    """Llama-like decoder layer whose output is 2^-6 of the stream's scale (arguments of very different scales)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norm1, self.norm2 = FusedAddRMSNorm(), FusedAddRMSNorm()
        self.w1 = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5)
        self.w2 = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.norm1(hidden_states.clone())
        else:
            hidden_states, residual = self.norm1(hidden_states, residual)
        hidden_states, residual = self.norm2(torch.tanh(hidden_states @ self.w1) / 64, residual)
        return torch.tanh(hidden_states @ self.w2) / 64, residual


class Decoder(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.layers = nn.ModuleList(Layer(i) for i in range(4))
        self.norm = norm
        self.embed = nn.Embedding(64, HIDDEN)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids) * 4, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.model = Decoder(norm)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)


def install(model, ids):
    tokens = torch.arange(3, 3 + TOKENS, device="cuda")
    check = CheckForward(lambda: model(tokens, tokens), contextlib.nullcontext, TOKENS)
    return install_aux_outputs(model, ids, mode="taps", check=check)  # "auto" asks vLLM (not installed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_proof_holds_on_a_cuda_fused_add_norm(dtype):
    """bf16/fp16 on CUDA, float32-adding Triton add-norm, scales 2^8 apart: the sum is proven, right at 0."""
    model = CausalLM(FusedAddRMSNorm()).to("cuda", dtype)
    info = install(model, [1, 2, 4])
    assert set(info["streams"].values()) == {"sum: hidden_states + residual (fused add-norm)",
                                             "sum: x + residual (fused add-norm)"}  # fmt: skip
    for line in info["stream_margins"].values():
        print(f"{dtype}: {line}")
        assert ": right 0 (" in line and float(line.rsplit("margin ", 1)[1].rstrip("x")) >= 8, line


def test_a_cuda_norm_reading_another_stream_is_refused():
    """bf16 on CUDA: a norm computing x + 2 * residual is none of the candidates: refused."""
    model = CausalLM(FusedAddRMSNorm(factor=2.0)).to("cuda", torch.bfloat16)
    with pytest.raises(StreamProofError, match=r"final norm \(FusedAddRMSNorm\): no known combination"):
        install(model, [4])
