"""Make a loaded vLLM 0.16 model return EAGLE-3 aux hidden states.

Runs in the worker, after model load and before profiling, warm-up and
compilation, so the compiled graph includes the capture. Ids are vLLM's
(``k`` = input of decoder layer ``k``; ``n`` = after the last layer, before
the final norm; see :mod:`speculators_v016.layers`).

Two sources, combined in ascending id order:

* **built-in**: models implementing vLLM's ``SupportsEagle3`` compute ids
  ``1 .. n-1`` in their own forward (``set_aux_hidden_state_layers``);
* **taps** (our adapter): forward pre-hooks on the decoder layers and on the
  final norm record the residual stream as the model itself passes it on.
  Which arguments make up the stream there (``hidden_states + residual`` for
  a fused add-norm, ``hidden_states`` alone for a parallel block that passes
  its ``residual`` along unused, the one tensor a post-norm layer takes) is
  never read from parameter names: :mod:`~speculators_v016.worker.stream_proof`
  establishes it on the loaded model before anything is installed, and after
  installation checks that every aux output (taps and built-in) equals the
  proven stream; otherwise the run is refused. They serve models without
  ``SupportsEagle3`` (Mixtral, DeepSeek-V2/V3, Kimi-K2.5, Command-R, GPT-NeoX,
  ...) and id ``n`` for every model. The model's own forward runs unchanged
  (so model-specific steps such as embedding scaling are kept); only the
  outermost model's class is swapped for a subclass whose ``forward`` returns
  ``(hidden, aux)`` as vLLM's runner expects when ``use_aux_hidden_state_outputs`` is on.

Under pipeline parallelism a process holds one stage's layers: only that
stage's ids are proven and tapped there, all as taps
(:mod:`~speculators_v016.worker.pipeline_stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from speculators_v016.worker.pipeline_stage import StageLayers, pipeline_capture_mode
from speculators_v016.worker.stream_proof import (
    CheckForward,
    Location,
    StreamConvention,
    StreamProofError,
    UnsupportedModelError,
    prove_streams,
    read,
    verify_aux,
)

__all__ = ["StreamProofError", "UnsupportedModelError", "find_decoder_stack", "install_aux_outputs"]

#: Where causal LMs hold their decoder, its layer list and its final norm (vLLM 0.16's names). Finding
#: them by name only locates candidates: the stream proof checks that the layers run in order and that
#: the norm's output is the model's output.
DECODER_NAMES = ("model", "transformer", "gpt_neox", "backbone")
LAYERS_NAMES = ("layers", "h", "blocks")
NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "final_norm", "embedding_norm")


@dataclass
class DecoderStack:
    """Where the decoder layers of a loaded model live."""

    outer: nn.Module  # what vLLM's runner calls
    language_model: nn.Module  # the causal LM (== outer unless multimodal)
    decoder: nn.Module  # holds the layers and the final norm
    layers: nn.ModuleList
    norm: nn.Module
    names: tuple[str, str, str]  # attribute names of decoder, layers, norm
    start: int = 0  # the layers this process holds: start .. end - 1 (all but under pipeline parallelism)
    end: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def partial(self) -> bool:
        return (self.start, self.end) != (0, self.num_layers)


def _one(owner: nn.Module, names: Sequence[str], kind: type) -> list[tuple[str, nn.Module]]:
    return [(name, getattr(owner, name)) for name in names if isinstance(getattr(owner, name, None), kind)]


def find_decoder_stack(model: nn.Module) -> DecoderStack:
    """Locate the decoder layers and the final norm, looking through multimodal wrappers.

    vLLM multimodal models (e.g. ``KimiK25ForConditionalGeneration``) expose
    their text model through ``get_language_model()`` or a ``language_model``
    attribute; causal LMs hold the decoder in ``.model`` (``.transformer``,
    ``.gpt_neox``, ``.backbone`` in some families), with its layers in
    ``.layers`` (``.h``, ``.blocks``) and its final norm in ``.norm`` (``.ln_f``,
    ``.final_layer_norm``, ``.final_layernorm``, ``.norm_f``, ``.final_norm``, LFM2's ``.embedding_norm``).
    """
    lm = model
    getter = getattr(model, "get_language_model", None)
    if callable(getter):
        lm = getter()
    elif isinstance(getattr(model, "language_model", None), nn.Module):
        lm = model.language_model
    found = [
        (d, ln, nm, decoder, layers, norm)
        for d, decoder in _one(lm, DECODER_NAMES, nn.Module)
        for ln, layers in _one(decoder, LAYERS_NAMES, nn.ModuleList)
        for nm, norm in _one(decoder, NORM_NAMES, nn.Module)
    ]
    where = f" inside its language model {type(lm).__name__}" if lm is not model else ""
    if len(found) != 1:
        raise UnsupportedModelError(
            f"cannot find the decoder layers of {type(model).__name__}{where}: expected one "
            f"<causal LM>.{{{','.join(DECODER_NAMES)}}} holding a ModuleList .{{{','.join(LAYERS_NAMES)}}} "
            f"and a final norm .{{{','.join(NORM_NAMES)}}}, found "
            + (", ".join(f"{d}.{ln} + {d}.{nm}" for d, ln, nm, *_ in found) or "none")
        )
    d, ln, nm, decoder, layers, norm = found[0]
    start, end = getattr(decoder, "start_layer", 0), getattr(decoder, "end_layer", len(layers))
    return DecoderStack(model, lm, decoder, layers, norm, (d, ln, nm), start, end)


def has_builtin_aux(model: nn.Module) -> bool:
    """Does vLLM implement EAGLE-3 aux outputs for this model class?"""
    from vllm.model_executor.models.interfaces import supports_eagle3  # noqa: PLC0415 - vLLM: tests/gpu run without it

    return bool(supports_eagle3(model)) and hasattr(model, "set_aux_hidden_state_layers")


def tap_locations(convention: StreamConvention) -> tuple[Location, ...]:
    """The arguments a tap adds up: the proven ones."""
    return convention.slots


class _Tap:
    """Forward pre-hook: record the residual stream at a module's input (the sum of the arguments at ``slots``)."""

    def __init__(self, sink: list, slots: tuple[Location, ...]):
        self.sink = sink
        self.slots = slots

    def __call__(self, module, args, kwargs):
        parts = [read(args, kwargs, where) for where in self.slots]
        self.sink.append(parts[0] if len(parts) == 1 else parts[0] + parts[1])


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


def install_aux_outputs(
    model: nn.Module,
    vllm_ids: Sequence[int],
    mode: str = "auto",
    *,
    check: CheckForward,
    stage: StageLayers | None = None,
) -> dict:
    """Prove the stream at ``vllm_ids``, install their capture on ``model``, verify it; return what was done.

    ``vllm_ids``: ascending, distinct, in ``1..n``. ``mode`` is ``auto``
    (built-in where the model has it, taps for the rest) or ``taps`` (taps for
    every id, also on built-in models). ``check`` runs the model's forward on a
    few tokens (:mod:`~speculators_v016.worker.stream_proof`); raises
    :class:`~speculators_v016.worker.stream_proof.StreamProofError` where the
    stream cannot be established or a recorded aux state is not it. ``stage``:
    the pipeline stage this process holds (:mod:`~speculators_v016.worker.pipeline_stage`;
    None: every layer); only its ids are captured here (``stage_ids`` in the result, maybe none).
    """
    stack = find_decoder_stack(model)
    n = stack.num_layers
    model_class = type(stack.language_model).__name__
    ids = tuple(vllm_ids)
    if list(ids) != sorted(set(ids)) or not ids or not all(1 <= k <= n for k in ids):
        raise ValueError(f"vLLM aux ids must be distinct, ascending and in 1..{n}, got {list(ids)}")
    if stage is None and stack.partial:
        raise UnsupportedModelError(
            f"{type(model).__name__} holds only decoder layers {stack.start}..{stack.end - 1} of {n} "
            "in this process (pipeline parallelism), and no pipeline stage was given"
        )
    stage = stage or StageLayers.whole(n)
    if (stage.start, stage.end, stage.num_layers) != (stack.start, stack.end, n):
        raise UnsupportedModelError(
            f"{stage.describe()} of {stage.num_layers}, but {type(model).__name__} holds layers "
            f"{stack.start}..{stack.end - 1} of {n} in this process"
        )
    mode = pipeline_capture_mode(mode, stage)
    info = {
        "model_class": model_class,
        "decoder_class": type(stack.decoder).__name__,
        "decoder": ".".join(stack.names),
        "num_layers": n,
        "stage": stage.rank,
        "stages": stage.size,
        "stage_layers": [stage.start, stage.end],
        "stage_rows": list(stage.rows(ids)),
    }
    ids = stage.ids(ids)
    if not ids:  # nothing captured on this stage: the model stays as it is
        return {**info, "stage_ids": [], "builtin_ids": [], "tap_ids": [], "streams": {}, "stream_margins": {}}
    conventions = prove_streams(stack.layers, stack.norm, ids, check, stage)
    builtin = mode == "auto" and has_builtin_aux(stack.outer)
    builtin_ids = tuple(k for k in ids if k < n) if builtin else ()
    tap_ids = tuple(k for k in ids if k not in builtin_ids)
    if builtin and not builtin_ids:
        builtin = False
    if builtin:
        stack.outer.set_aux_hidden_state_layers(builtin_ids)
    sink: list[torch.Tensor] = []
    for k in tap_ids:
        target = stack.layers[k] if k < n else stack.norm
        target.register_forward_pre_hook(_Tap(sink, tap_locations(conventions[k])), with_kwargs=True)
    if tap_ids:
        stack.outer.__class__ = _with_aux_outputs(type(stack.outer), sink, builtin)
    verify_aux(
        stack.layers, stack.norm, conventions, check, {k: "built-in" if k in builtin_ids else "tap" for k in ids}
    )
    return {
        **info,
        "stage_ids": list(ids),
        "builtin_ids": list(builtin_ids),
        "tap_ids": list(tap_ids),
        "streams": {k: conventions[k].kind for k in ids},
        "stream_margins": {k: conventions[k].margin_line() for k in ids},
    }
