"""Every captured layer against transformers on the same weights: the whole-model comparison.

:func:`reference_layer_outputs` runs the target in transformers (it must fit in memory here) and
keeps every decoder layer's output before the final norm; :func:`compare` gives, per requested
layer, the largest absolute error and the error relative to the largest reference value (the float32
criterion) and, per row, the median and the share of rows past a bound (the bf16/fp16 criterion,
:data:`ROW_BOUNDS`), with a pass/fail that depends on the engine's dtype. The ``check`` command
(:mod:`speculators_v016.run.check`) runs it beside the logit check and the layer replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

#: Largest allowed (max abs error / max abs reference value), by engine dtype (the float32 criterion).
RELATIVE_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
#: bf16 and fp16 engines are judged per row (token), ``||ours - fp32 reference|| / ||reference||``: the median
#: row of a layer within the first bound, at most :data:`FLIPPED_ROWS` of its rows past the second. bf16 keeps
#: 8 significant bits (unit roundoff 3.9e-3) and vLLM rounds weights and every activation to it: medians of
#: 6e-3 to 1.3e-2 measured on 20 families (tests/engine/test_model_families_bf16.py); fp16 (11 bits) 8x closer.
#: In an MoE a near-tied router flips its expert under that rounding and the row takes another expert's
#: output (0.1-0.7 off): the target's own behaviour in its dtype: up to 3.3% of a tiny MoE's rows on the AVX512
#: CPU build, 6.0% (GPT-OSS) on the AVX2 build, whose kernels round differently; the bound is 10%.
#: A wrong layer or rows one position off sit at medians of 0.24 and more.
ROW_BOUNDS = {"bfloat16": (2.5e-2, 5e-2), "float16": (2.5e-2 / 8, 5e-2 / 8)}
FLIPPED_ROWS = 0.10


@dataclass
class LayerError:
    layer: int
    max_abs: float
    relative: float
    tolerance: float
    median_row: float = 0.0  # median over rows of ||ours - reference|| / ||reference||
    rows_past: float = 0.0  # fraction of rows past the dtype's row bound (bf16/fp16)
    row_bounds: tuple[float, float] | None = None  # (median bound, row bound): judged per row

    @property
    def ok(self) -> bool:
        if self.row_bounds is None:
            return self.relative <= self.tolerance
        return self.median_row <= self.row_bounds[0] and self.rows_past <= FLIPPED_ROWS


def row_errors(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per row (token): ``||ours - reference|| / ||reference||``."""
    return (ours.float() - reference.float()).norm(dim=-1) / reference.float().norm(dim=-1).clamp_min(1e-12)


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
    bounds = ROW_BOUNDS.get(engine_dtype)
    errors = []
    for j, layer in enumerate(layer_ids):
        worst_abs = worst_rel = 0.0
        rows = []
        for res, ref in zip(results, reference):
            diff = (res["hidden_states"][j].float() - ref[layer]).abs().max().item()
            worst_abs = max(worst_abs, diff)
            worst_rel = max(worst_rel, diff / max(ref[layer].abs().max().item(), 1e-12))
            rows.append(row_errors(res["hidden_states"][j], ref[layer]))
        rows = torch.cat(rows)
        past = (rows > bounds[1]).float().mean().item() if bounds else 0.0
        errors.append(LayerError(layer, worst_abs, worst_rel, tolerance, rows.median().item(), past, bounds))
    return errors
