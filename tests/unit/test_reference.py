"""The yardstick itself: our reading of transformers' layers is transformers' own hidden_states."""

import torch
from transformers import AutoModelForCausalLM

from helpers.reference import hf_layer_outputs, random_prompts


def test_reference_hooks_equal_transformers_hidden_states(tiny_model):
    """The hooked layer outputs are transformers' output_hidden_states[L+1] (all but the normed last)."""
    model_dir = tiny_model("llama", 4)
    prompts = random_prompts([7, 12])
    ours = hf_layer_outputs(model_dir, prompts)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, layers in zip(prompts, ours):
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            assert len(layers) == 4
            for i in range(3):
                assert torch.equal(layers[i], states[i + 1][0])
