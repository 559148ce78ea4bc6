"""Reference states and comparisons: transformers on the same weights is the yardstick."""

from __future__ import annotations

import torch

from speculators_v016.checks.fidelity import reference_layer_outputs

NUM_LAYERS = 8
TOLERANCE = 1e-5  # fp32 max abs error against transformers
#: Engines of the parallel tests (TP, PP): every layer, fp32, eager, 128 tokens a step (chunked prefills)
CHUNKED_ENGINE = dict(
    layer_ids=list(range(NUM_LAYERS)),
    max_model_len=512,
    dtype="float32",
    enforce_eager=True,
    max_num_batched_tokens=128,
    max_num_seqs=4,
)


def random_prompts(lengths, vocab: int = 400, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_layer_outputs(model_dir: str, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    """transformers' output of every decoder layer (before the final norm), per prompt, in fp32."""
    return reference_layer_outputs(model_dir, prompts, torch.float32)


def max_abs_error(results: list[dict], reference: list[list[torch.Tensor]], layer_ids) -> float:
    worst = 0.0
    for res, ref in zip(results, reference):
        assert len(res["hidden_states"]) == len(layer_ids)
        for state, layer in zip(res["hidden_states"], layer_ids):
            assert state.shape == ref[layer].shape
            worst = max(worst, (state.float() - ref[layer]).abs().max().item())
    return worst
