"""What a layer id means, and how it maps to vLLM's aux hidden-state ids.

Two conventions meet here, and they differ by one:

* **Ours (upstream speculators')**: layer id ``L`` is the *output* of decoder
  layer ``L`` (0-based), before the final norm; that is transformers'
  ``output_hidden_states[L + 1]`` for ``L < n - 1``, and for ``L = n - 1`` the
  last layer's output *before* the final norm (transformers returns it
  normed). Valid ids: ``0 .. n-1``. Default ``[2, n//2, n-3, n-1]``.
* **vLLM's** (``set_aux_hidden_state_layers``, and the
  ``eagle_aux_hidden_state_layer_ids`` of a served EAGLE-3 draft): aux id
  ``k`` is ``hidden_states + residual`` at the *input* of decoder layer ``k``.
  So our ``L`` is vLLM's ``L + 1``; vLLM id ``n`` (after the last layer) is
  not produced by stock vLLM 0.16 and is served by our capture code.

A draft trained on our data consumes all layers but the last as inputs and
the last as the verifier's final hidden state; served by vLLM it must carry
``eagle_aux_hidden_state_layer_ids = [L + 1 for L in layer_ids[:-1]]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class LayerIdError(ValueError):
    """Layer ids that cannot be captured for this model."""


def default_layer_ids(num_layers: int) -> list[int]:
    """Upstream's default ``[2, n//2, n-3, n-1]`` (duplicates merged for tiny models)."""
    if num_layers < 1:
        raise LayerIdError(f"a model with {num_layers} decoder layers has no layer to capture")
    ids = [2, num_layers // 2, num_layers - 3, num_layers - 1]
    return sorted({i for i in ids if 0 <= i < num_layers})


@dataclass(frozen=True)
class LayerPlan:
    """The requested layers of one model, in both conventions."""

    num_layers: int
    layer_ids: tuple[int, ...]  # ours, in request order

    @classmethod
    def build(cls, num_layers: int, layer_ids: Sequence[int] | None) -> LayerPlan:
        if layer_ids is None:
            return cls(num_layers, tuple(default_layer_ids(num_layers)))
        ids = list(layer_ids)
        if not ids:
            raise LayerIdError("layer_ids is empty: give at least one layer id")
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
        if bad:
            raise LayerIdError(f"layer ids must be integers, got {bad!r}")
        out_of_range = [i for i in ids if not 0 <= i < num_layers]
        if out_of_range:
            raise LayerIdError(
                f"layer ids {out_of_range} are out of range: this model has {num_layers} decoder "
                f"layers, so ids run from 0 to {num_layers - 1} (id L = output of layer L)"
            )
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise LayerIdError(f"layer ids {dupes} are requested more than once in {ids}")
        return cls(num_layers, tuple(ids))

    @property
    def vllm_ids(self) -> tuple[int, ...]:
        """vLLM aux ids (input of layer ``k``) for the requested layers, in request order."""
        return tuple(i + 1 for i in self.layer_ids)

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """The distinct vLLM aux ids the workers capture, ascending (their output order)."""
        return tuple(sorted(set(self.vllm_ids)))

    @property
    def capture_order(self) -> tuple[int, ...]:
        """For each requested layer, its row in the captured (ascending) stack."""
        pos = {k: j for j, k in enumerate(self.capture_ids)}
        return tuple(pos[k] for k in self.vllm_ids)

    @property
    def last_layer_index(self) -> int | None:
        """Where layer ``n-1`` (the last, before the final norm) sits in ``layer_ids``; None if not requested."""
        return self.layer_ids.index(self.num_layers - 1) if self.num_layers - 1 in self.layer_ids else None

    @property
    def serving_ids(self) -> list[int]:
        """``eagle_aux_hidden_state_layer_ids`` for vLLM serving of a draft trained on this data."""
        return [i + 1 for i in self.layer_ids[:-1]]

    def describe(self) -> dict:
        """The mapping, as recorded in data files and configs."""
        return {
            "layer_ids": list(self.layer_ids),
            "layer_id_meaning": "output of decoder layer L (0-based), before the final norm; "
            "= transformers output_hidden_states[L+1] for L < n-1",
            "num_hidden_layers": self.num_layers,
            "vllm_aux_hidden_state_ids": list(self.vllm_ids),
            "eagle_aux_hidden_state_layer_ids": self.serving_ids,
        }
