"""Make a loaded vLLM 0.16 model return EAGLE-3 aux hidden states.

Runs in the worker, after model load and before profiling, warm-up and
compilation, so the compiled graph includes the capture. Ids are vLLM's
(``k`` = input of decoder layer ``k``; ``n`` = after the last layer, before
the final norm; see :mod:`speculators_v016.layers`).

Two sources, combined in ascending id order:

* **built-in**: models implementing vLLM's ``SupportsEagle3`` compute ids
  ``1 .. n-1`` in their own forward (``set_aux_hidden_state_layers``);
* **taps** (our adapter): forward pre-hooks on the decoder layers and on the
  final norm record the residual stream as the model itself passes it on:
  ``hidden_states + residual`` where the layer takes a ``residual`` (fused
  add-norm), ``hidden_states`` where it takes the stream whole. Sandwich norms
  (Gemma-2/3) and embedding scaling need nothing more: they act inside the
  layers and before the first one. They serve models without ``SupportsEagle3`` (Mixtral,
  DeepSeek-V2/V3, Kimi-K2.5, Qwen2-MoE, ...) and id ``n`` for every model.
  The model's own forward runs unchanged (so model-specific steps such as
  embedding scaling are kept); only the outermost model's class is swapped
  for a subclass whose ``forward`` returns ``(hidden, aux)`` as vLLM's
  runner expects when ``use_aux_hidden_state_outputs`` is on.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class UnsupportedModelError(TypeError):
    """The model's decoder stack cannot be found or tapped."""


@dataclass
class DecoderStack:
    """Where the decoder layers of a loaded model live."""

    outer: nn.Module  # what vLLM's runner calls
    language_model: nn.Module  # the causal LM (== outer unless multimodal)
    decoder: nn.Module  # holds .layers and .norm

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)


def find_decoder_stack(model: nn.Module) -> DecoderStack:
    """Locate ``layers`` and ``norm``, looking through multimodal wrappers.

    vLLM multimodal models (e.g. ``KimiK25ForConditionalGeneration``) expose
    their text model through ``get_language_model()`` or a ``language_model``
    attribute; causal LMs hold the decoder in ``.model``.
    """
    lm = model
    getter = getattr(model, "get_language_model", None)
    if callable(getter):
        lm = getter()
    elif isinstance(getattr(model, "language_model", None), nn.Module):
        lm = model.language_model
    decoder = getattr(lm, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not isinstance(getattr(decoder, "norm", None), nn.Module):
        raise UnsupportedModelError(
            f"cannot find the decoder layers of {type(model).__name__}: expected "
            f"<causal LM>.model.layers (a ModuleList) and .model.norm"
            + (f" inside its language model {type(lm).__name__}" if lm is not model else ""))
    start, end = getattr(decoder, "start_layer", 0), getattr(decoder, "end_layer", len(layers))
    if (start, end) != (0, len(layers)):
        raise UnsupportedModelError(
            f"{type(model).__name__} holds only decoder layers {start}..{end - 1} of {len(layers)} "
            "in this process (pipeline parallelism); capture needs every layer on the last stage")
    return DecoderStack(model, lm, decoder)


def has_builtin_aux(model: nn.Module) -> bool:
    """Does vLLM implement EAGLE-3 aux outputs for this model class?"""
    from vllm.model_executor.models.interfaces import supports_eagle3

    return bool(supports_eagle3(model)) and hasattr(model, "set_aux_hidden_state_layers")


def _arg_index(module: nn.Module, names: Sequence[str]) -> tuple[int, str]:
    """Positional index (in the call, without self) and name of the first parameter found."""
    forward = type(module).forward
    params = list(inspect.signature(forward).parameters.values())[1:]
    if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL:  # vLLM CustomOp dispatch
        forward = getattr(type(module), "forward_native", forward)
        params = list(inspect.signature(forward).parameters.values())[1:]
    params = [p.name for p in params]
    for name in names:
        if name in params:
            return params.index(name), name
    raise UnsupportedModelError(
        f"{type(module).__name__}.forward has none of the parameters {list(names)}; "
        "cannot read the residual stream there")


def _residual_arg(module: nn.Module) -> tuple[int, str] | None:
    """Where a layer receives the residual stream's second half, or None if it takes the stream whole.

    Two conventions are known: a ``residual`` parameter (vLLM's fused add-norm:
    the stream is ``hidden_states + residual``), or none (the layer's input is
    the stream). Any other parameter that names a residual is an unknown
    convention, refused rather than guessed.
    """
    try:
        return _arg_index(module, ("residual",))
    except UnsupportedModelError:
        forward = type(module).forward
        names = list(inspect.signature(getattr(type(module), "forward_native", forward)).parameters)
        names += list(inspect.signature(forward).parameters)
        odd = sorted({n for n in names if "residual" in n.lower()})
        if odd:
            raise UnsupportedModelError(
                f"{type(module).__name__}.forward has parameters {odd} but none named 'residual'; "
                "cannot tell how the residual stream arrives there") from None
        return None


class _Tap:
    """Forward pre-hook: record the residual stream at a module's input (``hidden_states`` [+ ``residual``])."""

    def __init__(self, module: nn.Module, sink: list, hidden_names: Sequence[str]):
        self.sink = sink
        self.h_at, self.h_name = _arg_index(module, hidden_names)
        self.r_at, self.r_name = _residual_arg(module) or (None, None)

    def _get(self, args, kwargs, at, name):
        return args[at] if len(args) > at else kwargs.get(name)

    def __call__(self, module, args, kwargs):
        hidden = self._get(args, kwargs, self.h_at, self.h_name)
        residual = None if self.r_at is None else self._get(args, kwargs, self.r_at, self.r_name)
        self.sink.append(hidden if residual is None else hidden + residual)


def _with_aux_outputs(base: type, sink: list, builtin: bool) -> type:
    """A subclass of the outer model class whose forward also returns the aux list."""

    def forward(self, *args, **kwargs):
        sink.clear()  # only what this forward pass records
        out = base.forward(self, *args, **kwargs)
        tapped = list(sink)
        sink.clear()
        if builtin and isinstance(out, tuple):
            hidden, aux = out
            return hidden, list(aux) + tapped
        return out, tapped

    return type(f"AuxOutputs{base.__name__}", (base,), {"forward": forward, "__module__": __name__})


def install_aux_outputs(model: nn.Module, vllm_ids: Sequence[int], mode: str = "auto") -> dict:
    """Install capture of ``vllm_ids`` (ascending, distinct) on ``model``; return what was done.

    ``mode`` is ``auto`` (built-in where the model has it, taps for the rest)
    or ``taps`` (taps for every id, also on built-in models: for testing).
    """
    stack = find_decoder_stack(model)
    n = stack.num_layers
    model_class = type(stack.language_model).__name__
    ids = tuple(vllm_ids)
    if list(ids) != sorted(set(ids)) or not ids or not all(1 <= k <= n for k in ids):
        raise ValueError(f"vLLM aux ids must be distinct, ascending and in 1..{n}, got {list(ids)}")
    builtin = mode == "auto" and has_builtin_aux(stack.outer)
    builtin_ids = tuple(k for k in ids if k < n) if builtin else ()
    tap_ids = tuple(k for k in ids if k not in builtin_ids)
    if builtin and not builtin_ids:
        builtin = False
    if builtin:
        stack.outer.set_aux_hidden_state_layers(builtin_ids)
    sink: list[torch.Tensor] = []
    for k in tap_ids:
        target = stack.decoder.layers[k] if k < n else stack.decoder.norm
        names = ("hidden_states", "x", "hidden", "input")
        target.register_forward_pre_hook(_Tap(target, sink, names), with_kwargs=True)
    if tap_ids:
        stack.outer.__class__ = _with_aux_outputs(type(stack.outer), sink, builtin)
    return {
        "model_class": model_class,
        "decoder_class": type(stack.decoder).__name__,
        "num_layers": n,
        "builtin_ids": list(builtin_ids),
        "tap_ids": list(tap_ids),
    }
