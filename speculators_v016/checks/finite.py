"""Is every value of a tensor finite? Read from the IEEE bits, in slices, on the calling thread only.

A float is NaN or infinite exactly when its exponent bits are all ones
(float8 e4m3fn, which has no infinity: when all its bits but the sign are),
that is when its magnitude bits are at least a threshold ``t``. Two maxima of
the tensor's integer views decide it, with no conversion and no temporary:
* as *signed* integers, negative values sort below every positive one and
  positive ones by magnitude, so ``max >= t`` exactly when a positive value is
  non-finite;
* as *unsigned* integers, values with the sign bit set sort above all others and
  among themselves by magnitude, so ``max >= sign | t`` exactly when a negative
  value is non-finite.

Numpy's integer maxima are vectorized, release the GIL and never start threads;
they run on slices of ``SLICE`` elements so a bad value ends the test early (the writer's chunks, already
small, in one pair).
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

from speculators_v016.fp8 import Fp8States

SLICE = 1 << 18  # elements per slice: a bad value ends the test within one slice

# dtype -> (signed view, unsigned view, smallest non-finite magnitude, sign bit): numpy types, so the
# comparisons are exact (no Python int is ever compared through a float)
_BITS = {
    torch.float64: (np.int64, np.uint64, 0x7FF0_0000_0000_0000, 1 << 63),
    torch.float32: (np.int32, np.uint32, 0x7F80_0000, 1 << 31),
    torch.float16: (np.int16, np.uint16, 0x7C00, 1 << 15),
    torch.bfloat16: (np.int16, np.uint16, 0x7F80, 1 << 15),
    torch.float8_e5m2: (np.int8, np.uint8, 0x7C, 1 << 7),
    torch.float8_e4m3fn: (np.int8, np.uint8, 0x7F, 1 << 7),  # no infinity; NaN is S.1111.111
}
_TESTS = {
    dtype: (signed, unsigned, signed(threshold), unsigned(sign | threshold))
    for dtype, (signed, unsigned, threshold, sign) in _BITS.items()
}


def _values_finite(raw: np.ndarray, dtype: torch.dtype, per_slice: int | None = None) -> bool:
    """``raw`` (one-dimensional, any integer or byte view of ``dtype``'s values) holds no NaN/Inf pattern;
    tested ``per_slice`` elements at a time (default :data:`SLICE`)."""
    signed, unsigned, positive, negative = _TESTS[dtype]
    values, flipped = raw.view(signed), raw.view(unsigned)
    step = max(per_slice or SLICE, 1)
    for start in range(0, values.size, step):
        if values[start : start + step].max() >= positive or flipped[start : start + step].max() >= negative:
            return False
    return True


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
