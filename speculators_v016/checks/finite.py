"""Is every value of a tensor finite? Read from the IEEE bits, in slices, on the calling thread only.

The test reads the IEEE bits: two integer maxima a slice of ``SLICE`` elements decide it, with no
conversion and no temporary (:mod:`~speculators_v016.checks.finite_bits`, the torch-free table and test
that a write helper process runs too); a bad value ends the test within one slice (the writer's chunks,
already small, in one pair).
``torch.isfinite(h).all()`` made a bool tensor as large as ``h`` per check and
ran at 0.4 GiB/s on bf16 (AVX2 host); masking the sign into a scratch slice and
taking one maximum ran at 17 GiB/s from the cache (AVX512 host), this at 30.

:func:`bytes_finite` runs the same test on raw bytes: the sample writer calls
it on each chunk of a file just after hashing that chunk, while it is still in
the core's cache, so the check costs no read of memory of its own (:mod:`~speculators_v016.store.atomic_files`).
"""

from __future__ import annotations

import numpy as np
import torch

from speculators_v016.checks import finite_bits
from speculators_v016.checks.finite_bits import SLICE, values_finite
from speculators_v016.fp8 import Fp8States

__all__ = ["SLICE", "all_finite", "bytes_finite", "non_finite", "non_finite_reason"]

# torch dtype -> its name in the torch-free table (speculators_v016.checks.finite_bits)
_TESTS = {getattr(torch, name): name for name in finite_bits.TESTS}


def _values_finite(raw: np.ndarray, dtype: torch.dtype, per_slice: int | None = None) -> bool:
    """``raw`` (one-dimensional, any integer or byte view of ``dtype``'s values) holds no NaN/Inf pattern;
    tested ``per_slice`` elements at a time (default :data:`SLICE`)."""
    return values_finite(raw, _TESTS[dtype], per_slice)


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element of ``tensor`` (on the CPU) is NaN or infinite."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype not in _TESTS:  # a float type without a table entry: the plain (slower) test
        return bool(torch.isfinite(tensor).all())
    return _values_finite(tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), tensor.dtype)


def bytes_finite(data, dtype: torch.dtype) -> bool:
    """True when ``data`` (a buffer of whole elements of the float type ``dtype``) holds no NaN/Inf.

    One pair of maxima over the whole buffer, not slices: the writer's chunks are already a few MiB, and
    each call is a trip through the GIL for a thread that writes beside the engine's."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size == 0:
        return True
    if dtype not in _TESTS:  # a float type without a table entry: the plain (slower) test
        return bool(torch.isfinite(torch.frombuffer(data, dtype=dtype)).all())
    return _values_finite(raw, dtype, per_slice=raw.size)


def non_finite(tensors: list) -> list[int]:
    """Positions in ``tensors`` of those holding a NaN or an infinity (FP8 layers: in their codes or scales)."""
    return [
        j
        for j, t in enumerate(tensors)
        if not (all_finite(t.codes) and all_finite(t.scales) if isinstance(t, Fp8States) else all_finite(t))
    ]


def non_finite_reason(layer_ids: list[int]):
    """The reason a run's writer gives for a sample it found NaN/Inf in: ``(its bad layer ids, its token count)``."""

    def reason(sample: dict) -> tuple[list[int], int] | None:
        bad = non_finite(sample["hidden_states"])
        return ([layer_ids[j] for j in bad], int(sample["input_ids"].shape[0])) if bad else None

    return reason
