"""The stream check's guard on vLLM's call-order MoE lookup: each MoE layer runs its own experts, or the check stops.

vLLM 0.16 on GPUs (``fast_moe_cold_start``) hands the fused-MoE op ``all_moe_layers[moe_layer_index]`` and
counts the index up per call; the check calls single layers, so it sets the index to the layer's own place
before the layer runs and refuses when the layer then looked up any other layer. The forward context is a
stand-in here (pure logic); the GPU tests run the guard on vLLM's real fused-MoE path.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from vllm import forward_context

from speculators_v016.worker import check_forward
from speculators_v016.worker.check_forward import MoeCallOrderError

LAYERS = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts", "model.layers.3.mlp.experts"]


class Moe(nn.Module):
    """Looks its experts up as vLLM's GPU op does: ``all_moe_layers[index]``, then the index moves on by ``step``."""

    def __init__(self, name: str, step: int = 1):
        super().__init__()
        self.layer_name, self.step, self.ran = name, step, []

    def forward(self, x):
        context = forward_context.get_forward_context()
        self.ran.append(context.all_moe_layers[context.moe_layer_index])
        context.moe_layer_index += self.step
        return x


@pytest.fixture
def context(monkeypatch):
    """A forward context whose call-order count starts where a previous pass left it (past the last layer)."""
    ctx = SimpleNamespace(all_moe_layers=list(LAYERS), moe_layer_index=len(LAYERS))
    monkeypatch.setattr(forward_context, "get_forward_context", lambda: ctx)
    return ctx


def guarded(layers: list[nn.Module]):
    return check_forward._moe_layers_run_their_own_experts(nn.ModuleList(layers), LAYERS)


@pytest.fixture(autouse=True)
def moe_class(monkeypatch):
    """The guard finds MoE layers by vLLM's ``FusedMoE`` class; the stand-in takes its place."""
    import vllm.model_executor.layers.fused_moe as fused_moe  # noqa: PLC0415

    monkeypatch.setattr(fused_moe, "FusedMoE", Moe)


def test_each_layer_called_alone_and_again_runs_its_own_experts(context):
    """Single layers, out of order and replayed, each look up their own experts under the guard."""
    layers = [Moe(name) for name in LAYERS]
    x = torch.zeros(2)
    with guarded(layers):
        for i in (2, 0, 1, 1, 2):
            layers[i](x)
    assert [layer.ran for layer in layers] == [[LAYERS[0]], [LAYERS[1]] * 2, [LAYERS[2]] * 2]


def test_without_the_guard_a_single_layer_runs_another_layers_experts(context):
    """The fault the guard exists for: a lone call of layer 2 after a full pass would read past the list."""
    layers = [Moe(name) for name in LAYERS]
    context.moe_layer_index = 0  # a fresh count: layer 3 called alone runs layer 1's experts
    layers[2](torch.zeros(2))
    assert layers[2].ran == [LAYERS[0]]


def test_a_layer_that_looks_up_more_than_once_is_refused_by_name(context):
    """A layer that moved the count by two (another layer's experts ran inside it) stops the check, named."""
    layers = [Moe(LAYERS[0]), Moe(LAYERS[1], step=2), Moe(LAYERS[2])]
    with guarded(layers), pytest.raises(MoeCallOrderError, match=r"MoE layer model\.layers\.2\.mlp\.experts ran 2"):
        layers[1](torch.zeros(2))


def test_a_layer_that_runs_itself_without_a_lookup_passes(context):
    """vLLM's CPU path: the layer computes with its own weights and leaves the count alone."""
    layers = [Moe(name, step=0) for name in LAYERS]
    with guarded(layers):
        layers[1](torch.zeros(2))
    assert layers[1].ran == [LAYERS[1]]


def test_the_hooks_are_gone_after_the_check(context):
    """Outside the check the model's own passes keep vLLM's counting untouched."""
    layers = [Moe(name) for name in LAYERS]
    with guarded(layers):
        pass
    context.moe_layer_index = 0
    layers[2](torch.zeros(2))
    assert layers[2].ran == [LAYERS[0]]
