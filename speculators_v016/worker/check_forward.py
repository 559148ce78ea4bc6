"""The stream check's forward inside a vLLM worker: a few tokens through the loaded model, eager.

It runs at capture set-up, after model load and before vLLM's profiling,
KV-cache allocation and warm-up, on every rank (tensor-parallel layers
communicate, so all ranks make the same calls; a pipeline stage after the
first gets fixed random intermediate tensors in place of what the stage
before would send, and sends nothing on). The decoder is called with
``skip_compiled`` (vLLM's own switch to bypass its compiled graph), so nothing
is compiled or captured here. There is no KV cache yet, hence no attention
metadata: vLLM's attention layers then return an unwritten buffer, so every
layer that holds a KV cache (attention, MLA, linear attention, SSM mixers:
vLLM's ``AttentionLayerBase``) has its output set to zero during the check,
which keeps the check's forwards deterministic. What the check establishes
(how the residual stream is wired through the layers) does not depend on
attention's values.

On GPUs vLLM 0.16 hands its fused-MoE op the layer to run by call order
(``fast_moe_cold_start``, on by default: the forward context counts MoE calls
and the n-th call runs ``all_moe_layers[n]``), which holds only for one pass
through the whole model. The check calls single layers, and some more than
once, so during the check each MoE layer sets the count to its own place
before it runs and confirms after that no other layer's experts ran (else the
check stops, naming the layer): a replayed layer never computes with another
layer's experts.
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


class MoeCallOrderError(RuntimeError):
    """A MoE layer of the check ran other experts than its own (vLLM's call-order lookup)."""


def _moe_pre(order: dict[str, int]):
    def hook(module: nn.Module, args, kwargs):
        from vllm.forward_context import get_forward_context  # noqa: PLC0415 - vLLM: tests/gpu run without it

        context = get_forward_context()
        if context.all_moe_layers is not None:
            context.moe_layer_index = order[module.layer_name]

    return hook


def _moe_post(order: dict[str, int]):
    def hook(module: nn.Module, args, kwargs, output):
        from vllm.forward_context import get_forward_context  # noqa: PLC0415 - vLLM: tests/gpu run without it

        context = get_forward_context()
        own = order[module.layer_name]
        # own + 1: the op looked its layer up (GPUs); own: the layer ran itself, no lookup (vLLM's CPU path)
        if context.all_moe_layers is not None and context.moe_layer_index not in (own, own + 1):
            raise MoeCallOrderError(
                f"the stream check's call of MoE layer {module.layer_name} ran "
                f"{context.moe_layer_index - own} MoE lookups instead of its own one"
            )

    return hook


@contextlib.contextmanager
def _moe_layers_run_their_own_experts(model: nn.Module, all_moe_layers: list[str]):
    from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: PLC0415 - vLLM: tests/gpu run without it

    order = {name: i for i, name in enumerate(all_moe_layers)}
    moe = [m for m in model.modules() if isinstance(m, FusedMoE) and getattr(m, "layer_name", None) in order]
    handles = [m.register_forward_pre_hook(_moe_pre(order), with_kwargs=True) for m in moe]
    handles += [m.register_forward_hook(_moe_post(order), with_kwargs=True) for m in moe]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
            _moe_layers_run_their_own_experts(model, runner.vllm_config.compilation_config.static_all_moe_layers),
        ):
            yield

    received = _received(model, runner, tokens)

    def run():
        with torch.inference_mode():
            intermediate = None
            if received is not None:  # fresh copies each run: layers may add into their inputs in place
                from vllm.sequence import IntermediateTensors  # noqa: PLC0415 - vLLM: tests/gpu run without it

                intermediate = IntermediateTensors({k: t.clone() for k, t in received.items()})
            return model(
                input_ids=input_ids, positions=positions, intermediate_tensors=intermediate, inputs_embeds=None
            )

    return CheckForward(run, context, tokens, tuple(received.values()) if received is not None else None)


def _received(model: nn.Module, runner, tokens: int) -> dict[str, torch.Tensor] | None:
    """A pipeline stage after the first: fixed random intermediate tensors, as if the stage before sent them
    (the model's own ``make_empty_intermediate_tensors`` gives their names and shapes)."""
    from vllm.distributed import get_pp_group  # noqa: PLC0415 - vLLM: tests/gpu run without it

    if get_pp_group().is_first_rank:
        return None
    empty = model.make_empty_intermediate_tensors(tokens, runner.dtype, runner.device)
    generator = torch.Generator().manual_seed(1)
    return {
        key: torch.randn(tuple(t.shape), generator=generator).to(dtype=t.dtype, device=t.device)
        for key, t in empty.tensors.items()
    }
