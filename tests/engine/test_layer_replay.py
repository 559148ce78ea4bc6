"""The layer replay of ``check`` on transformers' own states: exact where they are right, failing on a wrong layer.

No engine: for families vLLM's CPU backend cannot run here (hybrid stacks whose
linear-attention layers need GPU kernels), transformers' own per-layer outputs
stand in for captured states. The replay of layer L from layer L-1 reproduces
layer L bit for bit; a row that holds the wrong layer (as a tap reading the
wrong layer would record) fails at the scale of the stream. On the engine's
own states the replay runs in test_model_families and in the CLI's check tests.
"""

import pytest
import torch

from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.layer_replay import replay_inputs, replay_layers


@pytest.mark.parametrize("arch", ["qwen3_next", "minimax", "cohere"])
def test_replay_is_exact_and_catches_a_wrong_layer(arch, tiny_model):
    """Layers 1-3 replay exactly from transformers' own states; layer 2 holding layer 1 fails layers 2 and 3."""
    model_dir = tiny_model(arch, 4)
    states = [dict(enumerate(layers)) for layers in hf_layer_outputs(model_dir, random_prompts([30, 70], seed=2))]
    report = replay_layers(model_dir, states, [1, 2, 3], 1e-4)
    assert report.ok and [(r.layer, r.source) for r in report.rows] == [(1, 0), (2, 1), (3, 2)]
    assert all(r.max_abs == 0.0 for r in report.rows), report.lines()
    wrong = [{**s, 2: s[1].clone()} for s in states]
    bad = replay_layers(model_dir, wrong, [1, 2, 3], 1e-4)
    assert [r.ok for r in bad.rows] == [True, False, False]
    assert min(r.relative for r in bad.rows[1:]) > 0.1


def test_replay_inputs_are_the_layers_before():
    """Layer L is replayed from L-1: what the check captures besides the requested layers."""
    assert replay_inputs([2, 4, 5, 7]) == [1, 3, 6]
    assert replay_inputs([0, 1, 3]) == [2]


def test_a_model_transformers_cannot_build_is_skipped_with_the_reason(tmp_path):
    """No transformers implementation: the replay says so and skips (no failure, no guess)."""
    (tmp_path / "config.json").write_text('{"model_type": "no_such_family", "architectures": ["X"]}')
    report = replay_layers(str(tmp_path), [{0: torch.zeros(2, 4), 1: torch.zeros(2, 4)}], [1], 1e-4)
    assert report.ok and report.rows == []
    assert report.lines() == [f"layer replay: skipped ({report.skipped})"]
    assert "transformers cannot read this model's config" in report.skipped
