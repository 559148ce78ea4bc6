"""Every captured layer against transformers on the same weights: the whole-model comparison.

:func:`reference_layer_outputs` runs the target in transformers (it must fit in memory here) and
keeps every decoder layer's output before the final norm; :func:`compare` gives, per requested
layer, the largest absolute error and the error relative to the largest reference value, with a
pass/fail against a tolerance that depends on the engine's dtype. The ``check`` command
(:mod:`speculators_v016.run.check`) runs it beside the logit check and the layer replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Largest allowed (max abs error / max abs reference value), by engine dtype.
RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass
class LayerError:
    layer: int
    max_abs: float
    relative: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.relative <= self.tolerance


def decoder_layers(model) -> torch.nn.ModuleList:
    """A transformers causal LM's decoder layers (``model.layers``, ``gpt_neox.layers``, ``transformer.h``, ...)."""
    for decoder in (model.get_decoder(), model.base_model):
        for name in ("layers", "h", "blocks"):
            if isinstance(getattr(decoder, name, None), torch.nn.ModuleList):
                return getattr(decoder, name)
    raise TypeError(f"cannot find the decoder layers of transformers' {type(model).__name__}")


def reference_layer_outputs(
    model_path: str, prompts: list[list[int]], dtype: torch.dtype, trust_remote_code: bool = False
) -> list[list[torch.Tensor]]:
    """transformers' output of every decoder layer (before the final norm), per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code).eval()
    layers = decoder_layers(model)
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].float())
        )
        for i, layer in enumerate(layers)
    ]
    out = []
    with torch.no_grad():
        for ids in prompts:
            seen.clear()
            model(torch.tensor([ids]))
            out.append([seen[i] for i in range(len(layers))])
    for hook in hooks:
        hook.remove()
    return out


def compare(
    results: list[dict], reference: list[list[torch.Tensor]], layer_ids: list[int], engine_dtype: str
) -> list[LayerError]:
    tolerance = RELATIVE_TOLERANCE.get(engine_dtype, 5e-2)
    errors = []
    for j, layer in enumerate(layer_ids):
        worst_abs = worst_rel = 0.0
        for res, ref in zip(results, reference):
            diff = (res["hidden_states"][j].float() - ref[layer]).abs().max().item()
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(ref[layer].abs().max().item(), 1e-12))
        errors.append(LayerError(layer, worst_abs, worst_rel, tolerance))
    return errors
