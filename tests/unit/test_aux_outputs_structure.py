"""The aux-output adapter on model structures that cannot run on CPU vLLM (no engine).

DeepSeek-V3 and Kimi-K2.5 need MLA, which vLLM 0.16's CPU backend lacks; these
stand-ins have their structure: Kimi wraps a DeepSeek-V3 causal LM as
``language_model``, whose ``.model`` holds ``layers`` (called with a fourth
argument) and a fused add-norm. The stream proof's behaviour on layouts no
engine here runs is tested on stand-ins in test_stream_proof.py.
"""

import contextlib

import pytest
import torch
from torch import nn

from speculators_v016.worker.aux_outputs import UnsupportedModelError, find_decoder_stack
from speculators_v016.worker.aux_outputs import install_aux_outputs as _install
from speculators_v016.worker.pipeline_stage import StageLayers
from speculators_v016.worker.stream_proof import CheckForward, StreamProofError

IDS, POS = torch.tensor([3, 5, 7]), torch.tensor([0, 1, 2])


def install_aux_outputs(model, ids, mode="auto", inputs=(IDS, POS)):
    """install_aux_outputs with the stand-in's own forward as the check forward."""
    check = CheckForward(lambda: model(*inputs), contextlib.nullcontext, len(inputs[0]))
    return _install(model, ids, mode, check=check)


class FusedAddNorm(nn.Module):
    """Like vLLM's RMSNorm: norm(x, residual) -> (normed, x + residual)."""

    def forward(self, x, residual=None):
        total = x if residual is None else x + residual
        return total / total.norm(dim=-1, keepdim=True), total


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
        residual = hidden_states if residual is None else hidden_states + residual
        return residual * self.scale + positions[:, None], residual


class DeepseekV2Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(0.5 + i) for i in range(n))
        self.norm = FusedAddNorm()
        self.start_layer, self.end_layer = 0, n

    def forward(self, input_ids, positions):
        hidden, residual = input_ids.float()[:, None].repeat(1, 4), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, None)
        return self.norm(hidden, residual)[0]


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.model = DeepseekV2Model(n)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)


class KimiK25ForConditionalGeneration(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.language_model = DeepseekV3ForCausalLM(n)

    def get_language_model(self):
        return self.language_model

    def forward(self, input_ids, positions):
        return self.language_model(input_ids, positions)


def reference(model: DeepseekV2Model, input_ids, positions):
    """hidden + residual at the input of every layer and after the last (vLLM ids 1..n)."""
    hidden, residual, seen = input_ids.float()[:, None].repeat(1, 4), None, []
    for layer in model.layers:
        hidden, residual = layer(positions, hidden, residual, None)
        seen.append(hidden + residual)
    return seen


def test_finds_the_decoder_inside_a_multimodal_wrapper():
    """Kimi-K2.5-like wrapper -> language_model -> model.layers is found."""
    kimi = KimiK25ForConditionalGeneration(4)
    stack = find_decoder_stack(kimi)
    assert stack.decoder is kimi.language_model.model and stack.num_layers == 4
    assert stack.outer is kimi


def test_finds_the_decoder_through_a_language_model_attribute():
    """A wrapper with only a language_model attribute (no getter) is handled too."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.language_model = DeepseekV3ForCausalLM(3)

    assert find_decoder_stack(Wrapper()).num_layers == 3


def test_kimi_like_model_gets_exact_aux_outputs():
    """Taps on the DeepSeek stack return hidden+residual for the ids asked, in order."""
    kimi = KimiK25ForConditionalGeneration(5)
    info = install_aux_outputs(kimi, [1, 3, 5])
    fused = "sum: hidden_states + residual (fused add-norm)"
    margins = info.pop("stream_margins")
    assert sorted(margins) == [1, 3, 5] and all("right 0 (tolerance 4.8e-07)" in m for m in margins.values())
    assert info == {
        "model_class": "DeepseekV3ForCausalLM",
        "decoder_class": "DeepseekV2Model",
        "decoder": "model.layers.norm",
        "num_layers": 5,
        "stage": 0,
        "stages": 1,
        "stage_layers": [0, 5],
        "stage_rows": [0, 3],
        "stage_ids": [1, 3, 5],
        "builtin_ids": [],
        "tap_ids": [1, 3, 5],
        "streams": {1: fused, 3: fused, 5: "sum: x + residual (fused add-norm)"},
    }
    ids, pos = torch.tensor([3, 5, 7]), torch.tensor([0, 1, 2])
    out, aux = kimi(ids, pos)
    want = reference(kimi.language_model.model, ids, pos)
    assert len(aux) == 3
    for got, k in zip(aux, [1, 3, 5]):
        assert torch.equal(got, want[k - 1])
    assert torch.equal(out, kimi.language_model.model.norm(want[-1] * 0, want[-1])[0])
    _, again = kimi(ids, pos)  # the sink is emptied between calls
    assert len(again) == 3


def test_keyword_arguments_are_read_by_name():
    """A model that calls its layers with keywords is tapped from the right arguments."""

    class KeywordModel(DeepseekV2Model):
        def forward(self, input_ids, positions):
            hidden, residual = input_ids.float()[:, None].repeat(1, 4), None
            for layer in self.layers:
                hidden, residual = layer(positions=positions, hidden_states=hidden, residual=residual)
            return self.norm(hidden, residual=residual)[0]

    model = DeepseekV3ForCausalLM(3)
    model.model = KeywordModel(3)
    want = reference(model.model, IDS, POS)
    install_aux_outputs(model, [1, 2, 3])
    _, aux = model(IDS, POS)
    assert all(torch.equal(a, w) for a, w in zip(aux, want))


def test_model_without_decoder_layers_is_named():
    """A model with no recognisable decoder stack raises, naming its class."""

    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(2, 2)

    with pytest.raises(UnsupportedModelError, match="cannot find the decoder layers of Mystery"):
        install_aux_outputs(Mystery(), [1])


def test_a_partial_stack_needs_its_pipeline_stage():
    """A process holding only some layers is refused without its stage, and with a stage of other layers."""
    model = DeepseekV3ForCausalLM(4)
    model.model.start_layer, model.model.end_layer = 2, 4
    assert (find_decoder_stack(model).start, find_decoder_stack(model).end) == (2, 4)
    with pytest.raises(UnsupportedModelError, match="holds only decoder layers 2..3 of 4 .* no pipeline stage"):
        install_aux_outputs(model, [1, 3])
    with pytest.raises(UnsupportedModelError, match="stage 1 of 2: layers 1..3 of 4, but .* holds layers 2..3"):
        _install_on_stage(model, [1, 3], StageLayers(1, 2, 1, 4, 4))


def test_ids_out_of_range_are_refused():
    """vLLM aux ids must be distinct, ascending and within 1..n."""
    with pytest.raises(ValueError, match="1..4"):
        install_aux_outputs(DeepseekV3ForCausalLM(4), [0, 2])


class StreamLayer(nn.Module):
    """A pre-norm layer without fused add-norm: it receives the stream whole and returns it."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, positions, hidden_states):
        return hidden_states + self.scale * torch.tanh(hidden_states) + positions[:, None]


class StreamModel(nn.Module):
    def __init__(self, n, layer=StreamLayer):
        super().__init__()
        self.layers = nn.ModuleList(layer(0.5 + i) for i in range(n))
        self.norm = nn.LayerNorm(4)

    def forward(self, input_ids, positions):
        hidden = input_ids.float()[:, None].repeat(1, 4)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class StreamForCausalLM(nn.Module):
    def __init__(self, n, layer=StreamLayer):
        super().__init__()
        self.model = StreamModel(n, layer)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)


def test_layers_taking_the_stream_whole_are_tapped():
    """Layers without a residual argument: the tap reads their input, which is the stream."""
    model = StreamForCausalLM(3)
    install_aux_outputs(model, [1, 2, 3])
    ids, pos = torch.tensor([3, 5]), torch.tensor([0, 1])
    out, aux = model(ids, pos)
    hidden, want = ids.float()[:, None].repeat(1, 4), []
    for layer in model.model.layers:
        hidden = layer(pos, hidden)
        want.append(hidden)
    assert all(torch.equal(a, w) for a, w in zip(aux, want))
    assert torch.equal(out, model.model.norm(want[-1]))


def test_a_parameter_name_does_not_decide_the_convention():
    """A residual-named parameter the model never passes does not make the tap add it."""

    class OddLayer(StreamLayer):
        def forward(self, positions, hidden_states, residual_in=None):
            return super().forward(positions, hidden_states)

    model = StreamForCausalLM(2, OddLayer)
    info = install_aux_outputs(model, [1, 2])
    assert info["streams"] == {1: "whole: hidden_states", 2: "whole: input"}


class Int4Experts(nn.Module):
    """Like vLLM's CPU W4A8 MoE layer: int4 codes held as int8, a bf16 scale per group of 2."""

    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("w13_weight", torch.randint(-8, 8, (4, 4), generator=gen, dtype=torch.int8))
        self.register_buffer("w13_weight_scale", torch.rand(4, 2, generator=gen).to(torch.bfloat16))

    def forward(self, x):
        weight = self.w13_weight.float() * self.w13_weight_scale.float().repeat_interleave(2, dim=1)
        return x @ weight.T


class Int4MoeLayer(DeepseekV2DecoderLayer):
    """A decoder layer whose MLP is quantized experts (fused add-norm at its input, as DeepSeek's)."""

    def __init__(self, scale):
        super().__init__(scale)
        self.experts = Int4Experts(int(scale * 10))

    def forward(self, positions, hidden_states, residual, llama_4_scaling=None):
        residual = hidden_states if residual is None else hidden_states + residual
        return self.experts(residual) * 0.1 + positions[:, None], residual


def test_int4_moe_structure_is_tapped_without_touching_the_experts():
    """INT4 experts (which no x86 CPU engine runs) sit inside the layers: taps read the stream exactly."""
    model = DeepseekV3ForCausalLM(3)
    model.model.layers = nn.ModuleList(Int4MoeLayer(0.5 + i) for i in range(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    install_aux_outputs(model, [1, 2, 3])
    ids, pos = torch.tensor([3, 5, 7]), torch.tensor([0, 1, 2])
    _, aux = model(ids, pos)
    assert all(torch.equal(a, w) for a, w in zip(aux, reference(model.model, ids, pos)))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # quantized weights untouched
    assert not any(m._forward_pre_hooks for m in model.modules() if isinstance(m, Int4Experts))


class Gpt2LikeLM(nn.Module):
    """transformer.h + ln_f, the GPT-2 / BLOOM / Falcon naming."""

    def __init__(self, n):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(StreamLayer(0.5 + i) for i in range(n))
        self.transformer.ln_f = nn.LayerNorm(4)

    def forward(self, input_ids, positions):
        hidden = input_ids.float()[:, None].repeat(1, 4)
        for layer in self.transformer.h:
            hidden = layer(positions, hidden)
        return self.transformer.ln_f(hidden)


def test_decoders_held_under_other_names_are_found_and_tapped():
    """transformer.h + ln_f (and gpt_neox.layers + final_layer_norm) are found; the proof checks the structure."""
    model = Gpt2LikeLM(3)
    info = install_aux_outputs(model, [1, 3])
    assert info["decoder"] == "transformer.h.ln_f" and info["streams"] == {1: "whole: hidden_states", 3: "whole: input"}
    _, aux = model(IDS, POS)
    assert torch.equal(aux[1], model.transformer.h[2](POS, model.transformer.h[1](POS, aux[0])))


def test_two_candidate_decoders_are_refused():
    """Two places that could hold the decoder: refused, both named, rather than one picked."""
    model = DeepseekV3ForCausalLM(2)
    model.transformer = DeepseekV2Model(2)
    with pytest.raises(
        UnsupportedModelError,
        match=r"found model.layers \+ model.norm, transformer.layers \+ "
        r"transformer.norm",
    ):
        find_decoder_stack(model)


class Intermediate:
    """vLLM's IntermediateTensors, as far as the proof reads it: the tensors a stage sends on, by name."""

    def __init__(self, tensors):
        self.tensors = tensors


class StageModel(nn.Module):
    """A DeepseekV2Model holding layers ``start .. end - 1`` of ``n`` (a pipeline stage; the others missing)."""

    def __init__(self, n, start, end, send=None, before_first=None):
        super().__init__()
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(0.5 + i) if start <= i < end else nn.Identity() for i in range(n)
        )
        self.norm = FusedAddNorm() if end == n else nn.Identity()
        self.start_layer, self.end_layer, self.n = start, end, n
        self.send = send or (lambda hidden, residual: {"hidden_states": hidden, "residual": residual})
        self.before_first = before_first or (lambda hidden: hidden)

    def forward(self, input_ids, positions, intermediate=None):
        if self.start_layer == 0:
            hidden, residual = input_ids.float()[:, None].repeat(1, 4), None
        else:
            hidden, residual = (
                self.before_first(intermediate.tensors["hidden_states"]),
                intermediate.tensors["residual"],
            )
        for layer in self.layers[self.start_layer : self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, None)
        if self.end_layer < self.n:
            return Intermediate(self.send(hidden, residual))
        return self.norm(hidden, residual)[0]


class StageLM(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, intermediate=None):
        return self.model(input_ids, positions, intermediate)


def _install_on_stage(model, ids, stage, received=None):
    """install_aux_outputs on one stage, its check forward handed ``received`` (hidden, residual) when not first."""

    def run():
        given = (
            Intermediate({"hidden_states": received[0].clone(), "residual": received[1].clone()}) if received else None
        )
        return model(IDS, POS, given)

    check = CheckForward(run, contextlib.nullcontext, len(IDS), received)
    return _install(model, ids, "auto", check=check, stage=stage)


def test_each_stage_proves_and_taps_its_own_layers():
    """Stage 0 of 2 taps id 1 and sends on (hidden, residual); stage 1 taps the boundary id 2 and the final norm's
    input from what it received, equal to one whole model's stream."""
    whole = reference(DeepseekV2Model(4), IDS, POS)  # ids 1..4: the input of layers 1..3, then the final norm's
    first = StageLM(StageModel(4, 0, 2))
    info = _install_on_stage(first, [1, 2, 4], StageLayers(0, 2, 0, 2, 4))
    assert (info["stage_ids"], info["stage_rows"], info["tap_ids"]) == ([1], [0, 1], [1])
    sent, aux = first(IDS, POS)
    assert torch.equal(aux[0], whole[0])
    second = StageLM(StageModel(4, 2, 4))
    received = (sent.tensors["hidden_states"], sent.tensors["residual"])
    info = _install_on_stage(second, [1, 2, 4], StageLayers(1, 2, 2, 4, 4), received)
    assert (info["stage_ids"], info["stage_rows"]) == ([2, 4], [1, 3])
    assert "first layer" not in str(info["streams"])
    _, aux = second(IDS, POS, Intermediate({"hidden_states": received[0], "residual": received[1]}))
    assert torch.equal(aux[0], whole[1]) and torch.equal(aux[1], whole[3])


def test_a_stage_that_sends_on_something_else_is_refused():
    """Planted: a stage that sends (residual, hidden) in place of (hidden, residual): the proof names the stage."""
    swapped = StageLM(StageModel(4, 0, 2, send=lambda h, r: {"hidden_states": r, "residual": h}))
    with pytest.raises(StreamProofError, match="stage 0 of 2: layers 0..1 does not send on what its last layer 1"):
        _install_on_stage(swapped, [1, 2], StageLayers(0, 2, 0, 2, 4))


def test_a_stage_whose_first_layer_gets_another_stream_is_refused():
    """Planted: a stage that changes what it received before its first layer: refused at the boundary."""
    sent, _ = StageLM(StageModel(4, 0, 2))(IDS, POS), None
    received = (sent.tensors["hidden_states"], sent.tensors["residual"])
    changed = StageLM(StageModel(4, 2, 4, before_first=lambda h: h * 2))
    with pytest.raises(StreamProofError, match="layer 2 .*does not receive what the previous pipeline stage returned"):
        _install_on_stage(changed, [2, 4], StageLayers(1, 2, 2, 4, 4), received)
