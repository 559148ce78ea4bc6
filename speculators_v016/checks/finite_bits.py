"""The NaN/Inf test on raw bytes, by dtype name, without torch: what a write helper process imports.

A float is NaN or infinite exactly when its exponent bits are all ones (float8 e4m3fn, which has no
infinity: when all its bits but the sign are), that is when its magnitude bits are at least a threshold
``t``. Two maxima of the values' integer views decide it, with no conversion and no temporary:
* as *signed* integers, negative values sort below every positive one and positive ones by magnitude, so
  ``max >= t`` exactly when a positive value is non-finite;
* as *unsigned* integers, values with the sign bit set sort above all others and among themselves by
  magnitude, so ``max >= sign | t`` exactly when a negative value is non-finite.
Numpy's integer maxima are vectorized, release the GIL and never start threads.
:mod:`~speculators_v016.checks.finite` runs the same test on tensors (its table is this one, by torch dtype).
"""

from __future__ import annotations

import numpy as np

SLICE = 1 << 18  # elements per slice: a bad value ends the test within one slice

# dtype name -> (signed view, unsigned view, smallest non-finite magnitude, sign bit): numpy types, so the
# comparisons are exact (no Python int is ever compared through a float)
BITS = {
    "float64": (np.int64, np.uint64, 0x7FF0_0000_0000_0000, 1 << 63),
    "float32": (np.int32, np.uint32, 0x7F80_0000, 1 << 31),
    "float16": (np.int16, np.uint16, 0x7C00, 1 << 15),
    "bfloat16": (np.int16, np.uint16, 0x7F80, 1 << 15),
    "float8_e5m2": (np.int8, np.uint8, 0x7C, 1 << 7),
    "float8_e4m3fn": (np.int8, np.uint8, 0x7F, 1 << 7),  # no infinity; NaN is S.1111.111
}
TESTS = {
    name: (signed, unsigned, signed(threshold), unsigned(sign | threshold))
    for name, (signed, unsigned, threshold, sign) in BITS.items()
}


def values_finite(raw: np.ndarray, name: str, per_slice: int | None = None) -> bool:
    """``raw`` (one-dimensional, any integer or byte view of the values of the dtype ``name``, a key of
    :data:`TESTS`) holds no NaN/Inf pattern; tested ``per_slice`` elements at a time (default :data:`SLICE`)."""
    signed, unsigned, positive, negative = TESTS[name]
    values, flipped = raw.view(signed), raw.view(unsigned)
    step = max(per_slice or SLICE, 1)
    for start in range(0, values.size, step):
        if values[start : start + step].max() >= positive or flipped[start : start + step].max() >= negative:
            return False
    return True


def bytes_finite(data, name: str) -> bool:
    """True when ``data`` (a buffer of whole elements of the float dtype ``name``, a key of :data:`TESTS`) holds
    no NaN/Inf: one pair of maxima over the whole buffer (the writers' chunks are already a few MiB)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    return raw.size == 0 or values_finite(raw, name, per_slice=raw.size)
