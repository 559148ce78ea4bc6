"""The stream proof on stand-in layouts: it finds the stream by behaviour and refuses what it cannot prove.

Stand-ins (no engine) for the layouts vLLM 0.16 uses: a fused add-norm that
works in place (vLLM's kernel), a parallel block that takes a ``residual`` it
passes along without adding (Command-R), and layouts that must be refused.
The engine-level tests (tests/engine/test_stream_proof_engine.py) run the
same proof on real vLLM models.
"""

import contextlib

import pytest
import torch
from torch import nn

from speculators_v016.worker import aux_outputs, stream_proof
from speculators_v016.worker.aux_outputs import install_aux_outputs
from speculators_v016.worker.stream_proof import CheckForward, StreamProofError, UnsupportedModelError

HIDDEN = 8
IDS, POS = torch.tensor([3, 5, 7, 11, 2]), torch.arange(5)


def rms(x):
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


class InPlaceAddNorm(nn.Module):
    """Like vLLM's fused_add_rms_norm kernel: residual += x, x = norm(residual), both in place."""

    def forward(self, x, residual=None):
        if residual is None:
            return rms(x)
        residual.add_(x)
        x.copy_(rms(residual))
        return x, residual


class Mixer(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.w)


class FusedLayer(nn.Module):
    """Llama-like: the stream is hidden_states + residual."""

    def __init__(self, seed):
        super().__init__()
        self.norm1, self.norm2, self.mix, self.mlp = InPlaceAddNorm(), InPlaceAddNorm(), Mixer(seed), Mixer(seed + 50)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.norm1(hidden_states)
        else:
            hidden_states, residual = self.norm1(hidden_states, residual)
        hidden_states, residual = self.norm2(self.mix(hidden_states), residual)
        return self.mlp(hidden_states), residual


class LayerNormPassingResiduals(nn.Module):
    """Command-R's norm: normalizes hidden_states, hands ``residuals`` back untouched."""

    def forward(self, hidden_states, residuals=None):
        return rms(hidden_states), residuals


class ParallelLayer(nn.Module):
    """Command-R-like: attention and MLP from one norm; the residual argument is overwritten, not added."""

    def __init__(self, seed):
        super().__init__()
        self.input_layernorm, self.mix, self.mlp = LayerNormPassingResiduals(), Mixer(seed), Mixer(seed + 50)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return residual + self.mix(hidden_states) + self.mlp(hidden_states), residual


class Decoder(nn.Module):
    def __init__(self, layer, norm, n=4):
        super().__init__()
        self.layers = nn.ModuleList(layer(i) for i in range(n))
        self.norm = norm
        self.embed = nn.Embedding(16, HIDDEN)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    def __init__(self, layer=FusedLayer, norm=None, n=4):
        super().__init__()
        self.model = Decoder(layer, norm if norm is not None else InPlaceAddNorm(), n)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)


def check_of(model) -> CheckForward:
    return CheckForward(lambda: model(IDS, POS), contextlib.nullcontext, len(IDS))


def install(model, ids, mode="auto"):
    return install_aux_outputs(model, ids, mode, check=check_of(model))


def streams(model) -> dict[int, torch.Tensor]:
    """The stream at every layer boundary (vLLM ids 1..n), computed by hand from the layers' own outputs."""
    dec, seen = model.model, {}
    with torch.no_grad():
        hidden, residual = dec.embed(IDS), None
        for i, layer in enumerate(dec.layers):
            hidden, residual = layer.forward(POS, hidden.clone(), None if residual is None else residual.clone())
            parallel = isinstance(layer, ParallelLayer)
            seen[i + 1] = hidden.clone() if parallel else hidden + residual
    return seen


def test_fused_add_norm_in_place_is_proven_and_tapped_exactly():
    """hidden_states + residual is proven for an in-place fused add-norm; taps record it bit for bit."""
    model = CausalLM(FusedLayer)
    want = streams(model)
    info = install(model, [1, 2, 4])
    assert info["streams"] == {
        1: "sum: hidden_states + residual (fused add-norm)",
        2: "sum: hidden_states + residual (fused add-norm)",
        4: "sum: x + residual (fused add-norm)",
    }
    _, aux = model(IDS, POS)
    assert all(torch.equal(a, want[k]) for a, k in zip(aux, [1, 2, 4]))


def test_parallel_block_stream_is_hidden_states_alone():
    """A Command-R-like block: hidden_states alone is proven (its residual is passed along); taps record it."""
    model = CausalLM(ParallelLayer, LayerNormPassingResiduals())
    want = streams(model)
    info = install(model, [2, 3, 4])
    assert info["streams"] == {
        2: "hidden_states alone (residual passed along, not added)",
        3: "hidden_states alone (residual passed along, not added)",
        4: "hidden_states alone (residuals passed along, not added)",
    }
    _, aux = model(IDS, POS)
    assert all(torch.equal(a, want[k]) for a, k in zip(aux, [2, 3, 4]))
    # what a guess from the parameter names (hidden_states + residual) would have recorded: far off
    with torch.no_grad():
        layer_input = model.model.layers[1].forward(
            POS, model.model.layers[0].forward(POS, model.model.embed(IDS), None)[0], None
        )
    assert (layer_input[0] + layer_input[1] - want[2]).abs().max() > 0.1


def test_a_wrong_tap_formula_is_refused_parallel_block(monkeypatch):
    """Injected: taps add the residual on a parallel block (the old name-based guess) -> refused, named."""
    monkeypatch.setattr(aux_outputs, "tap_locations", lambda conv: (("arg", 1), ("arg", 2)))
    with pytest.raises(
        StreamProofError,
        match=r"aux id 2 \(tap\) at layer 2 \(ParallelLayer\): recorded max abs "
        r"difference [0-9.e+-]+ from the proven stream \(hidden_states alone",
    ):
        install(CausalLM(ParallelLayer, LayerNormPassingResiduals()), [2])


def test_a_wrong_tap_formula_is_refused_fused_add_norm(monkeypatch):
    """Injected: taps drop the residual of a fused add-norm layer -> refused, named."""
    monkeypatch.setattr(aux_outputs, "tap_locations", lambda conv: conv.slots[:1])
    with pytest.raises(
        StreamProofError,
        match=r"aux id 3 \(tap\) at layer 3 \(FusedLayer\): recorded max abs "
        r"difference .* \(sum: hidden_states \+ residual",
    ):
        install(CausalLM(FusedLayer), [3])


class ScaledResidualLayer(FusedLayer):
    """The stream would be hidden_states + 2 * residual: none of the known conventions."""

    def forward(self, positions, hidden_states, residual):
        return super().forward(positions, hidden_states, None if residual is None else residual * 2)


def test_an_unknown_combination_is_refused():
    """A layer whose outputs depend on neither h+r, h nor r alone is refused, with what was seen."""
    with pytest.raises(
        StreamProofError,
        match=r"layer 2 \(ScaledResidualLayer\): no known combination of its "
        r"arguments \['hidden_states', 'residual'\] reproduces its outputs",
    ):
        install(CausalLM(ScaledResidualLayer), [2])


class ConstantLayer(nn.Module):
    def __init__(self, seed):
        super().__init__()

    def forward(self, positions, hidden_states, residual):
        return torch.ones_like(hidden_states), torch.ones_like(hidden_states)


def test_a_stream_that_cannot_be_told_apart_is_refused():
    """Outputs that do not depend on the inputs cannot prove anything: refused."""
    with pytest.raises(StreamProofError, match=r"layer 1 \(ConstantLayer\): the stream cannot be told apart"):
        install(CausalLM(ConstantLayer), [1])


class ScalingDecoder(Decoder):
    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
            hidden = hidden * 2  # something between layers: not what the layer returned
        return self.norm(hidden, residual)[0]


def test_a_stream_changed_between_layers_is_refused():
    """A model that alters the stream between layers is refused (the tap would not see a layer's output)."""
    model = CausalLM()
    model.model = ScalingDecoder(FusedLayer, InPlaceAddNorm())
    with pytest.raises(StreamProofError, match=r"layer 1 \(FusedLayer\): does not receive what layer 0 returned"):
        install(model, [1])


class LoopingDecoder(Decoder):
    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids), None
        for layer in [*self.layers, self.layers[1]]:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


def test_a_layer_run_twice_is_refused():
    """A decoder that runs a layer more than once per forward (looped layers) is refused."""
    model = CausalLM()
    model.model = LoopingDecoder(FusedLayer, InPlaceAddNorm())
    with pytest.raises(StreamProofError, match=r"does not run each layer once, in order.*\{'layer 1': 2\}"):
        install(model, [1])


class AfterNormDecoder(Decoder):
    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions) * 3


def test_a_norm_that_is_not_the_last_step_is_refused():
    """If the model's output is not the final norm's output, the module taken for the norm is wrong: refused."""
    model = CausalLM()
    model.model = AfterNormDecoder(FusedLayer, InPlaceAddNorm())
    with pytest.raises(StreamProofError, match="the model's output is not its final norm's output"):
        install(model, [4])


class ThreeStreamsLayer(FusedLayer):
    def forward(self, positions, hidden_states, residual, embeddings=None):
        return super().forward(positions, hidden_states, residual)


class ThreeStreamsDecoder(Decoder):
    def forward(self, input_ids, positions):
        embeds = self.embed(input_ids)
        hidden, residual = embeds, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, embeds)
        return self.norm(hidden, residual)[0]


def test_more_than_two_stream_shaped_arguments_are_refused():
    """A layer that gets three [tokens, hidden] tensors has no known convention: refused."""
    model = CausalLM()
    model.model = ThreeStreamsDecoder(ThreeStreamsLayer, InPlaceAddNorm())
    with pytest.raises(StreamProofError, match=r"layer 2 \(ThreeStreamsLayer\): has 3 arguments shaped like"):
        install(model, [2])


def test_stream_proof_error_is_an_unsupported_model_error():
    """Callers that handle unsupported models also handle an unproven stream."""
    assert issubclass(StreamProofError, UnsupportedModelError)


class Eagle3LikeLM(CausalLM):
    """Stands in for a SupportsEagle3 model whose own aux outputs record hidden_states without the residual."""

    supports_eagle3, has_own_lm_head, has_own_embed_tokens = True, False, False

    def set_aux_hidden_state_layers(self, layers):
        self.aux_layers = tuple(layers)

    def get_eagle3_aux_hidden_state_layers(self):
        return (2,)

    def forward(self, input_ids, positions):
        dec, aux = self.model, []
        hidden, residual = dec.embed(input_ids), None
        for i, layer in enumerate(dec.layers):
            if i in getattr(self, "aux_layers", ()):
                aux.append(hidden.clone())  # wrong: the stream is hidden + residual here
            hidden, residual = layer(positions, hidden, residual)
        out = dec.norm(hidden, residual)[0]
        return (out, aux) if aux else out


def test_vllm_builtin_aux_outputs_are_checked_too():
    """A built-in (SupportsEagle3) aux output that is not the proven stream is refused, named as built-in."""
    with pytest.raises(StreamProofError, match=r"aux id 2 \(built-in\) at layer 2 \(FusedLayer\): recorded max abs"):
        install(Eagle3LikeLM(FusedLayer), [2, 4])
    info = install(Eagle3LikeLM(FusedLayer), [2, 4], mode="taps")  # our taps instead: proven and exact
    assert info["builtin_ids"] == [] and info["tap_ids"] == [2, 4]


def test_a_forward_that_fails_is_refused_with_its_error():
    """If the check forward itself raises, the capture is refused and the error is named."""

    def no_kv_cache():
        raise RuntimeError("no KV cache")

    model = CausalLM(FusedLayer)
    check = CheckForward(no_kv_cache, contextlib.nullcontext, len(IDS))
    with pytest.raises(StreamProofError, match=r"the model's forward on 5 check tokens failed: RuntimeError: no KV"):
        install_aux_outputs(model, [1], check=check)


# -- every dtype vLLM runs: exact crafted sums, thresholds from the outputs' dtype --------------------------


def ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of ``x`` (in its dtype)."""
    eps = torch.finfo(x.dtype).eps
    return torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(torch.finfo(x.dtype).tiny)))) * eps


class Float32AddNorm(nn.Module):
    """Like vLLM's fused add-RMSNorm kernels: adds in float32, rounds residual and output to the input dtype."""

    def __init__(self, noise_ulps: float = 0.0):
        super().__init__()
        self.noise_ulps, self.calls = noise_ulps, 0

    def forward(self, x, residual=None):
        total = x.float() if residual is None else x.float() + residual.float()
        out = rms(total).to(x.dtype)
        if self.noise_ulps:  # a kernel that rounds its last step differently on every call
            self.calls += 1
            signs = torch.randint(-1, 2, out.shape, generator=torch.Generator().manual_seed(self.calls))
            out = (out.float() + self.noise_ulps * signs * ulp(out)).to(x.dtype)
        if residual is None:
            return out
        residual.copy_(total.to(residual.dtype))
        x.copy_(out)
        return x, residual


class SmallOutputLayer(FusedLayer):
    """A fused add-norm layer whose output (hidden_states) is 2^-7 of the residual's scale, or 2^7 of it."""

    def __init__(self, seed, factor=2.0**-7):
        super().__init__(seed)
        self.norm1, self.norm2, self.factor = Float32AddNorm(), Float32AddNorm(), factor

    def forward(self, positions, hidden_states, residual):
        hidden_states, residual = super().forward(positions, hidden_states, residual)
        return hidden_states * self.factor, residual


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("factor", [2.0**-7, 2.0**7], ids=["small-output", "large-output"])
def test_arguments_of_very_different_scales_are_proven_in_every_dtype(dtype, factor):
    """A float32-adding fused add-norm with arguments 2^7 apart in scale: proven exactly (right at 0) in each dtype."""
    model = in_dtype(CausalLM(lambda seed: SmallOutputLayer(seed, factor), Float32AddNorm()), dtype)
    info = install(model, [1, 2, 4])
    assert set(info["streams"].values()) == {"sum: hidden_states + residual (fused add-norm)",
                                             "sum: x + residual (fused add-norm)"}  # fmt: skip
    for line in info["stream_margins"].values():
        assert ": right 0 (" in line and float(line.rsplit("margin ", 1)[1].rstrip("x")) >= 8, line


def test_crafted_arguments_share_one_power_of_two():
    """The crafted pair has one scale whatever the real arguments' scales, and its sum is exact in bf16."""
    generator = torch.Generator().manual_seed(0)
    a, b = stream_proof._crafted([torch.full((5, 8), 2.0**-6, dtype=torch.bfloat16),
                                  torch.full((5, 8), 2.0**3, dtype=torch.bfloat16)], generator)  # fmt: skip
    assert a.abs().max() <= 2.0**3 and b.abs().max() <= 2.0**3 and a.abs().max() >= 2.0**1
    assert stream_proof._exact_sum(a, b)


def test_a_crafted_sum_that_is_not_exact_is_refused(monkeypatch):
    """Injected: each argument on its own power of two (the old crafting) -> the sum rounds in bf16 -> refused."""

    def own_scales(likes, generator):
        out = []
        for like in likes:
            power = 2.0 ** round(torch.log2(like.float().pow(2).mean().sqrt()).item())
            grid = torch.randint(-64, 65, tuple(like.shape), generator=generator).float() / 64
            out.append((grid * power).to(like.dtype))
        return out

    monkeypatch.setattr(stream_proof, "_crafted", own_scales)
    model = in_dtype(CausalLM(SmallOutputLayer, Float32AddNorm()), torch.bfloat16)
    with pytest.raises(StreamProofError, match=r"layer 2 \(SmallOutputLayer\): the crafted stream a \+ b is not "
                                               r"exact in torch.bfloat16"):  # fmt: skip
        install(model, [2])


def test_thresholds_come_from_the_outputs_dtype():
    """Right within 4 ulps of the outputs' dtype, wrong beyond 8x that (at least 5e-2); the least precise wins."""
    t = {d: stream_proof.thresholds([torch.zeros(2, dtype=d)]) for d in (torch.bfloat16, torch.float16, torch.float32)}
    assert t[torch.bfloat16] == (4 * 2.0**-7, 8 * 4 * 2.0**-7)
    assert t[torch.float16] == (4 * 2.0**-10, 5e-2)
    assert t[torch.float32] == (4 * 2.0**-23, 5e-2)
    assert stream_proof.thresholds([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)]) == t[torch.bfloat16]


@pytest.mark.parametrize("dtype,noise", [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 2)], ids=str)
def test_a_consumer_off_by_a_few_ulps_is_proven(dtype, noise):
    """A final norm whose outputs move by up to 2 ulps on every call (another kernel's rounding) still passes."""
    model = in_dtype(CausalLM(SmallOutputLayer, Float32AddNorm(noise_ulps=noise)), dtype)
    info = install(model, [4])
    assert info["streams"] == {4: "sum: x + residual (fused add-norm)"}
    assert ": right 0 (" not in info["stream_margins"][4]  # the noise was seen, and tolerated


def test_a_consumer_far_noisier_than_its_dtype_is_refused():
    """A final norm 24 ulps of bf16 off on every call cannot tell the candidates apart within bounds: refused."""
    model = in_dtype(CausalLM(SmallOutputLayer, Float32AddNorm(noise_ulps=24)), torch.bfloat16)
    with pytest.raises(
        StreamProofError,
        match=r"final norm \(Float32AddNorm\): (the stream cannot be told apart|"
        r"no known combination).*right within 0.031, wrong beyond 0.25",
    ):
        install(model, [4])


class DoubledResidualNorm(Float32AddNorm):
    """Reads the wrong stream: x + 2 * residual."""

    def forward(self, x, residual=None):
        return super().forward(x, None if residual is None else residual * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_consumer_reading_another_stream_is_refused_in_every_dtype(dtype):
    """x + 2 * residual is none of the candidates: refused in bf16 as in fp32, with the thresholds named."""
    model = in_dtype(CausalLM(SmallOutputLayer, DoubledResidualNorm()), dtype)
    with pytest.raises(StreamProofError, match=r"final norm \(DoubledResidualNorm\): no known combination"):
        install(model, [4])
