"""The families our users train drafts for, each on the CPU engine against transformers.

Every layer of a tiny random model (4 layers, fp32, chunked prefill) is compared
with transformers on the same weights, relative to the layer's size: the error
over max(1, largest |value| of the layer), since fp32 rounding grows with the
values (post-norm OLMo-2 and Gemma's scaled embeddings reach 10+, where the
relative error is the same ~1e-6 as Llama's). The tolerance is 1e-5 wherever
vLLM's own forward agrees with transformers; where it does not, the difference
is vLLM's (named per family) and our taps are checked against an independent
reading of vLLM's own forward instead (hooks on its decoder layers): bit for bit.
Every family also passes the layer replay of ``check`` on the engine's states
(transformers' layer L from our captured L-1 against our captured L).
"""

import pytest
import torch

from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.layer_replay import replay_layers
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.worker.aux_outputs import find_decoder_stack

LAYERS = 4
LENGTHS = [40, 200, 3, 90]
ENGINE = dict(
    layer_ids=list(range(LAYERS)),
    max_model_len=512,
    dtype="float32",
    enforce_eager=True,
    max_num_batched_tokens=128,
    max_num_seqs=3,
)
SOFTCAP_NOTE = (
    "attention logit soft-capping: vLLM's CPU attention and transformers differ by this much "
    "(8.6e-6 with soft-capping off)"
)
FUSED, WHOLE = "sum: hidden_states + residual (fused add-norm)", "whole: hidden_states"
PARALLEL = "hidden_states alone (residual passed along, not added)"

# arch -> (aux source, tolerance, why not 1e-5)
FAMILIES = {
    "cohere": (
        "taps",
        1e-5,
        "Command-R: parallel block (attention and MLP from one LayerNorm); its residual "
        "argument is passed along, not added: proven at start-up, taps read hidden_states",
    ),
    "cohere2": (
        "taps",
        1e-5,
        "Command-R7B / Command-A: parallel block; sliding-window layers with RoPE, global layers without",
    ),
    "gpt_neox": ("taps", 1e-5, "parallel residual; decoder held as gpt_neox.layers + final_layer_norm"),
    "llama4": (
        "built-in",
        1e-5,
        "text model, dense layers only (vLLM's CPU MoE asserts on Llama 4's router "
        "weight applied to the input); chunked attention (128), NoPE layer, qk norm",
    ),
    "ernie4_5_moe": (
        "taps",
        1e-5,
        "dense first layer, then MoE with a shared expert; expert-score correction "
        "bias zero (vLLM 0.16's CPU routing drops it; its GPU routing applies it)",
    ),
    "deepseek_v3": ("taps", 1e-5, "VLLM_MLA_DISABLE=1; q rotary made exact on CPU (speculators_v016.worker.cpu_rope)"),
    "deepseek_v2": ("taps", 1e-5, "V2-Lite-like (no q LoRA); VLLM_MLA_DISABLE=1; q rotary made exact on CPU"),
    "qwen2_moe": ("taps", 1e-5, ""),
    "glm4_moe": ("taps", 1e-5, ""),
    "phi3": ("built-in", 1e-5, ""),
    "olmo2": ("taps", 1e-5, "layers take the residual stream as one tensor (no residual argument)"),
    "gemma3": ("taps", 1e-5, "text model; sandwich norms, embeddings scaled by sqrt(hidden)"),
    "gemma2": ("taps", 2e-3, SOFTCAP_NOTE),
    "exaone4": (
        "taps",
        1e-5,
        "post-norm blocks; a layer hands on the stream and an intermediate, the final norm takes the stream alone",
    ),
}


NO_LOGIT_CHECK = {
    arch: "the final norm is not an RMSNorm; use `check` with transformers"
    for arch in ("cohere", "cohere2", "gpt_neox")
}

# how the stream reaches each tapped layer and the final norm, where it is not a fused add-norm
STREAMS = {
    "cohere": (PARALLEL, "hidden_states alone (residuals passed along, not added)"),
    "cohere2": (PARALLEL, "hidden_states alone (residuals passed along, not added)"),
    "gpt_neox": (WHOLE, "whole: input"),
    "olmo2": (WHOLE, "whole: x"),
    "exaone4": (PARALLEL, "whole: x"),
}


@pytest.fixture(scope="module")
def family_model(tiny_model):
    return lambda arch: tiny_model(arch, LAYERS)


def vllm_layer_outputs(gen, prompt: list[int]) -> list[torch.Tensor]:
    """vLLM's own residual stream after each decoder layer, read with hooks (uniprocess, one prefill step)."""
    model = gen.engine.executor.driver_worker.worker.model_runner.get_model()
    layers = find_decoder_stack(model).decoder.layers
    seen: dict[int, torch.Tensor] = {}

    def hook(index):
        def keep(module, args, out):
            hidden, residual = out if isinstance(out, tuple) else (out, None)
            stream = hidden if residual is None else hidden + residual
            seen.setdefault(index, stream[: len(prompt)].clone())  # the prefill, not the decode step after it

        return keep

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        [result] = gen.generate([prompt])
    finally:
        for handle in handles:
            handle.remove()
    return result["hidden_states"], [seen[i] for i in range(len(layers))]


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_matches_transformers(arch, family_model, record_architecture):
    """Every layer equals transformers (family tolerance) and replays exactly; the last gives vLLM's logits."""
    source, tolerance, note = FAMILIES[arch]
    model_dir = family_model(arch)
    prompts = random_prompts(LENGTHS, seed=3)
    with VllmHiddenStatesGenerator(model_dir, **ENGINE) as gen:
        engine = gen.engine
        info = engine.capture_info[0]
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        results = [None] * len(prompts)
        for index, ids, states in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: checker.active):
            results[index] = {"hidden_states": states}
            if checker.active:
                checker.add(index, torch.tensor(ids), states, engine.prompt_logprobs.pop(index))
        if arch in NO_LOGIT_CHECK:  # LayerNorm final norms: the logit check says so (the replay covers them)
            assert checker.result.unavailable == NO_LOGIT_CHECK[arch]
        else:
            assert checker.result.ok and checker.result.max_abs < 1e-5, checker.result.line()  # vLLM's own logits
        if tolerance > 1e-5:  # vLLM differs from transformers: check our taps against vLLM itself
            ours, theirs = vllm_layer_outputs(gen, prompts[1][:100])
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), "taps differ from vLLM's own layers"
    assert (info["builtin_ids"] != []) == (source == "built-in")
    assert set(info["streams"].values()) <= set(STREAMS.get(arch, (FUSED, "sum: x + residual (fused add-norm)")))
    reference = hf_layer_outputs(model_dir, prompts)
    worst = relative = scale = 0.0
    for layer in range(LAYERS):
        error = max((r["hidden_states"][layer] - ref[layer]).abs().max().item() for r, ref in zip(results, reference))
        size = max(ref[layer].abs().max().item() for ref in reference)
        worst, scale, relative = max(worst, error), max(scale, size), max(relative, error / max(1.0, size))
    record_architecture(
        arch,
        info["model_class"],
        source,
        "engine (CPU, fp32)",
        worst,
        tolerance,
        f"relative {relative:.1e} (largest value {scale:.1f}); {note}".rstrip("; "),
    )
    assert relative < tolerance
    replay = replay_layers(model_dir, [dict(enumerate(r["hidden_states"])) for r in results[:2]], [1, 2, 3], tolerance)
    assert replay.ok and len(replay.rows) == 3, replay.lines()
    if arch.startswith("deepseek"):
        assert info["cpu_rope_native"] == LAYERS  # every attention's rotary made exact


def test_deepseek_taps_equal_vllms_own_layers(family_model):
    """On DeepSeek-V3 our taps equal vLLM's own decoder-layer outputs bit for bit (independent reading)."""
    with VllmHiddenStatesGenerator(family_model("deepseek_v3"), **ENGINE) as gen:
        ours, theirs = vllm_layer_outputs(gen, random_prompts([100], seed=5)[0])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_vllm_cpu_rotary_misreads_3d_query():
    """vLLM 0.16's CPU rotary kernel rotates a 3-D [tokens, heads, dim] q wrongly (why cpu_rope exists)."""
    from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415 - vLLM: slow to import, this test only
    from vllm.model_executor.layers.rotary_embedding import (  # noqa: PLC0415 - vLLM: slow to import, this test only
        get_rope,
    )

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            32,
            max_position=512,
            is_neox_style=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            dtype=torch.float32,
        )
    positions = torch.arange(9)
    q = torch.randn(9, 4, 64, generator=torch.Generator().manual_seed(0))
    q_pe, k_pe = q[..., 32:], torch.randn(9, 1, 32, generator=torch.Generator().manual_seed(1))
    want_q, want_k = rope.forward_native(positions, q_pe.clone(), k_pe.clone())
    got_q, got_k = rope.forward_cpu(positions, q_pe.clone(), k_pe.clone())
    assert torch.allclose(got_k, want_k, atol=1e-6)  # one head: right
    assert (got_q - want_q).abs().max().item() > 0.1  # several heads: wrong positions
