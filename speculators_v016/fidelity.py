"""``speculators-data-gen check``: the engine's hidden states against transformers, per layer.

Runs a handful of samples through the generator and through transformers on
the same weights (where transformers can load the target) and reports, per
requested layer, the largest absolute error and the error relative to the
largest reference value, with a pass/fail against a tolerance that depends on
the engine's dtype.
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


def reference_layer_outputs(model_path: str, prompts: list[list[int]], dtype: torch.dtype,
                            trust_remote_code: bool = False) -> list[list[torch.Tensor]]:
    """transformers' output of every decoder layer (before the final norm), per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, trust_remote_code=trust_remote_code).eval()
    layers = model.get_decoder().layers
    seen: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].float()))
        for i, layer in enumerate(layers)]
    out = []
    with torch.no_grad():
        for ids in prompts:
            seen.clear()
            model(torch.tensor([ids]))
            out.append([seen[i] for i in range(len(layers))])
    for hook in hooks:
        hook.remove()
    return out


def compare(results: list[dict], reference: list[list[torch.Tensor]], layer_ids: list[int],
            engine_dtype: str) -> list[LayerError]:
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
