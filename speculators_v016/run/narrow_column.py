"""A column of integers that grows as rows are read, in the narrowest of a few dtypes that holds every value so far.

The row index (:mod:`speculators_v016.run.row_index`) keeps four integers a row; most of its columns' values are
small (a row's input is one of a few, its turns are few, its line fits int32), yet a value may be large on a real
dataset (thousands of inputs, a file of billions of lines, a pre-tokenized row of 100k ids). A column starts in its
narrowest dtype and is copied to the next wider one the first time a value does not fit (Python's ``array`` refuses
it: ``OverflowError``), so memory follows the values and no value is ever cut. :meth:`array` gives the values as a
numpy array over the column's own buffer, no copy.
"""

from __future__ import annotations

from array import array

import numpy as np

#: the ``array`` type codes a column may take, narrowest first, and their numpy dtypes (those the prepared-rows
#: cache holds: speculators_v016.store.prepared_cache.DTYPES)
DTYPES = {"B": np.uint8, "i": np.int32, "q": np.int64}


class NarrowColumn:
    """Integers appended in order; ``typecodes``: the dtypes it may take, narrowest first (of :data:`DTYPES`)."""

    def __init__(self, typecodes: str = "Biq"):
        if not typecodes or any(code not in DTYPES for code in typecodes):
            raise ValueError(f"typecodes {typecodes!r}: each one of {''.join(DTYPES)}")
        self._wider = list(typecodes[1:])
        self.values = array(typecodes[0])

    @property
    def typecode(self) -> str:
        return self.values.typecode

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> int:
        return self.values[i]

    def append(self, value: int) -> None:
        try:
            self.values.append(value)
        except OverflowError:
            self._widen()
            self.append(value)

    def extend(self, values) -> None:
        """Append ``values`` (a sequence of ints, not an iterator: read again after widening)."""
        start = len(self.values)
        try:
            self.values.extend(values)
        except OverflowError:
            del self.values[start:]  # what was appended before the value that did not fit
            self._widen()
            self.extend(values)

    def _widen(self) -> None:
        """The column copied to its next wider dtype (OverflowError where it has none)."""
        if not self._wider:
            raise OverflowError(f"a value does not fit the column's widest dtype ({self.values.typecode!r})")
        self.values = array(self._wider.pop(0), self.values)

    def array(self) -> np.ndarray:
        """The values as a numpy array of the column's dtype, over its buffer (append no more after)."""
        dtype = DTYPES[self.values.typecode]
        return np.frombuffer(self.values, dtype) if len(self.values) else np.zeros(0, dtype)
