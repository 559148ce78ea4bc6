"""Hidden states a real model never produces: a layer all zeros, or one row repeated at every position.

Such states come from a broken capture (a ring replaced by an empty file, a
copy that never happened), not from a model: every decoder layer's output
carries its token's embedding and, through attention, its position. They are
also invisible to the NaN/Inf check and to the logit check when the last layer
is not captured. A layer counts as repeated only where the prompt has at least
two distinct tokens (identical tokens may legitimately give identical rows in a
model without positional encoding).

:func:`degenerate_layers` reads every value (``verify``); :func:`may_be_degenerate`
looks at two rows per layer, what a run can afford per sample: no degenerate
layer passes it, and what it flags is confirmed by :func:`degenerate_layers`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators_v016.fp8 import Fp8States, row_values


def _distinct_tokens(input_ids: torch.Tensor) -> bool:
    return input_ids.numel() > 1 and bool((input_ids != input_ids.reshape(-1)[0]).any())


def may_be_degenerate(input_ids: torch.Tensor, states: Sequence[torch.Tensor]) -> bool:
    """Cheap screen (two rows per layer): False proves no layer is all zeros or one repeated row."""
    distinct = _distinct_tokens(input_ids)
    for h in states:
        if h.shape[0] == 0:
            continue
        first, last = row_values(h, 0), row_values(h, -1)
        if not bool(last.any()) or (distinct and torch.equal(first, last)):
            return True
    return False


def degenerate_layers(input_ids: torch.Tensor, states: Sequence[torch.Tensor]) -> list[tuple[int, str]]:
    """``(position in states, what is wrong)`` for each layer that no real model produces."""
    distinct = _distinct_tokens(input_ids)
    found = []
    for j, h in enumerate(states):
        if isinstance(h, Fp8States):
            h = h.dequantize()
        if h.shape[0] == 0:
            continue
        if not bool(h.any()):
            found.append((j, "every value is 0"))
        elif distinct and h.shape[0] > 1 and bool((h == h[0]).all()):
            found.append((j, f"all {h.shape[0]} positions hold the same row, though the tokens differ"))
    return found
