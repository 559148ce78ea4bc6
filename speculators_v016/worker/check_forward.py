"""The stream check's forward inside a vLLM worker: a few tokens through the loaded model, eager.

It runs at capture set-up, after model load and before vLLM's profiling,
KV-cache allocation and warm-up, on every rank (tensor-parallel layers
communicate, so all ranks make the same calls). The decoder is called with
``skip_compiled`` (vLLM's own switch to bypass its compiled graph), so nothing
is compiled or captured here. There is no KV cache yet, hence no attention
metadata: vLLM's attention layers then return an unwritten buffer, so every
layer that holds a KV cache (attention, MLA, linear attention, SSM mixers:
vLLM's ``AttentionLayerBase``) has its output set to zero during the check,
which keeps the check's forwards deterministic. What the check establishes
(how the residual stream is wired through the layers) does not depend on
attention's values.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from speculators_v016.worker.stream_proof import CHECK_TOKENS, CheckForward


def _silence(module: nn.Module, args, kwargs, output):
    if isinstance(output, torch.Tensor):
        return torch.zeros_like(output)
    if output is None:  # mixers that write into an output buffer they are given (vLLM's SSM and conv layers)
        for buffer in [*args[1:], *kwargs.values()]:
            if isinstance(buffer, torch.Tensor) and buffer.is_floating_point() and not isinstance(buffer, nn.Parameter):
                buffer.zero_()
    return None


@contextlib.contextmanager
def _silent_kv_layers(model: nn.Module):
    from vllm.model_executor.layers.attention_layer_base import (  # noqa: PLC0415 - vLLM: tests/gpu run without it
        AttentionLayerBase,
    )

    handles = [
        m.register_forward_hook(_silence, with_kwargs=True)
        for m in model.modules()
        if isinstance(m, AttentionLayerBase)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def engine_check_forward(runner) -> CheckForward:
    """A :class:`CheckForward` on ``runner``'s model: :data:`CHECK_TOKENS` fixed random tokens at positions 0..T-1."""
    from vllm.forward_context import set_forward_context  # noqa: PLC0415 - vLLM: tests/gpu run without it

    model = runner.get_model()
    tokens = CHECK_TOKENS
    vocab = runner.model_config.get_vocab_size()
    input_ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).to(runner.device)
    positions = torch.arange(tokens, device=runner.device)
    if getattr(runner, "uses_mrope", False):
        positions = positions.expand(3, tokens).contiguous()
    elif getattr(runner, "uses_xdrope_dim", 0) > 0:
        positions = positions.expand(runner.uses_xdrope_dim, tokens).contiguous()

    @contextlib.contextmanager
    def context():
        with (
            set_forward_context(None, runner.vllm_config, num_tokens=tokens, skip_compiled=True),
            _silent_kv_layers(model),
        ):
            yield

    def run():
        with torch.inference_mode():
            return model(input_ids=input_ids, positions=positions, intermediate_tensors=None, inputs_embeds=None)

    return CheckForward(run, context, tokens)
