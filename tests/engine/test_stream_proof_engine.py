"""The start-up stream proof on the CPU engine: the issue's parallel-block case, and injected wrong taps.

Command-R's decoder layers take a ``residual`` they pass along without adding
it. Guessed from the parameter's name, taps recorded ``hidden_states +
residual`` there: off by 0.3 to 0.7 with no error. Proven from the layer's
behaviour, the stream is ``hidden_states`` alone, whatever layers are asked
for; and a tap formula made wrong on purpose makes the engine refuse to start.
"""

import pytest

from helpers.reference import TOLERANCE, hf_layer_outputs, max_abs_error, random_prompts
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.worker import aux_outputs
from speculators_v016.worker.stream_proof import StreamProofError

ENGINE = dict(max_model_len=512, dtype="float32", enforce_eager=True, max_num_batched_tokens=128, max_num_seqs=3)


@pytest.mark.parametrize("layer_ids", [None, [1, 3]], ids=["default", "1-3"])
def test_parallel_block_is_exact_for_any_layers(tiny_model, layer_ids):
    """Command-R (8 layers): default layers [2, 4, 5, 7] and --layer-ids 1 3 both equal transformers."""
    model_dir = tiny_model("cohere", 8)
    prompts = random_prompts([40, 200, 3], seed=7)
    with VllmHiddenStatesGenerator(model_dir, layer_ids=layer_ids, **ENGINE) as gen:
        info = gen.engine.capture_info[0]
        results = gen.generate(prompts)
    ids = layer_ids or [2, 4, 5, 7]
    assert info["tap_ids"] == [i + 1 for i in ids]
    assert all(kind.startswith("hidden_states alone") for kind in info["streams"].values())
    assert max_abs_error(results, hf_layer_outputs(model_dir, prompts), ids) < TOLERANCE


def test_a_wrong_tap_formula_is_refused_on_a_parallel_block(tiny_model, monkeypatch):
    """Injected: the taps add the residual (the old guess) -> the engine refuses to start, naming the layer."""
    monkeypatch.setattr(aux_outputs, "tap_locations", lambda conv: (("arg", 1), ("arg", 2)))
    with pytest.raises(
        StreamProofError,
        match=r"aux id 2 \(tap\) at layer 2 \(CohereDecoderLayer\): recorded max "
        r"abs difference [0-9.e+-]+ from the proven stream \(hidden_states "
        r"alone \(residual passed along, not added\)\)",
    ):
        VllmHiddenStatesGenerator(tiny_model("cohere", 8), layer_ids=[1, 3], **ENGINE)


def test_a_wrong_tap_formula_is_refused_on_a_fused_add_norm(tiny_model, monkeypatch):
    """Injected: the taps drop the residual of a fused add-norm (Mixtral) -> refused, naming the layer."""
    monkeypatch.setattr(aux_outputs, "tap_locations", lambda conv: conv.slots[:1])
    with pytest.raises(
        StreamProofError,
        match=r"aux id 3 \(tap\) at layer 3 \(MixtralDecoderLayer\): recorded max "
        r"abs difference .* \(sum: hidden_states \+ residual",
    ):
        VllmHiddenStatesGenerator(tiny_model("mixtral", 8), layer_ids=[2], **ENGINE)


def test_an_engine_starts_after_a_refused_one(tiny_model):
    """A refused start leaves no vLLM state behind: the next engine in the process (an MoE) runs."""
    with VllmHiddenStatesGenerator(tiny_model("mixtral", 8), layer_ids=[2], **ENGINE) as gen:
        [result] = gen.generate(random_prompts([20], seed=1))
    assert result["hidden_states"][0].shape == (20, 128)
