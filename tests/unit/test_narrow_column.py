"""The row index's columns (run/narrow_column.py): the narrowest dtype that holds every value, never a value cut."""

import numpy as np
import pytest

from speculators_v016.run.narrow_column import NarrowColumn


def test_a_column_stays_narrow_while_its_values_fit():
    """Small values: uint8 (one byte a row), the numpy array over the column's own buffer."""
    column = NarrowColumn("Biq")
    column.extend([0, 1, 255])
    column.append(7)
    out = column.array()
    assert out.dtype == np.uint8 and out.tolist() == [0, 1, 255, 7] and not out.flags.owndata
    assert len(column) == 4 and column[2] == 255


def test_a_value_that_does_not_fit_widens_the_column_and_keeps_every_value():
    """A value past a dtype widens the column: the values before it kept once, none cut, in order."""
    column = NarrowColumn("Biq")
    column.extend([3, 4])
    column.extend([5, 300, 6])  # 300 is past uint8: the 5 appended before it is not kept twice
    assert column.typecode == "i" and column.array().tolist() == [3, 4, 5, 300, 6]
    column.append(2**40)
    assert column.array().dtype == np.int64 and column.array().tolist() == [3, 4, 5, 300, 6, 2**40]
    column.append(-1)  # a negative value fits int64
    assert column.array().tolist()[-1] == -1
    signed = NarrowColumn("Bi")
    signed.extend([1, -2])
    assert signed.array().dtype == np.int32 and signed.array().tolist() == [1, -2]


def test_a_value_past_the_widest_dtype_is_refused_not_cut():
    """Past the widest dtype allowed: OverflowError, the column as it was."""
    column = NarrowColumn("i")
    column.extend([1, 2])
    with pytest.raises(OverflowError, match="widest"):
        column.extend([3, 2**31])
    assert column.array().tolist() == [1, 2] and column.array().dtype == np.int32


def test_an_empty_column_and_unknown_dtypes():
    """An empty column is an empty array of its dtype; a type code the cache cannot hold is refused."""
    assert NarrowColumn("iq").array().dtype == np.int32 and len(NarrowColumn().array()) == 0
    for codes in ("", "h", "Bf"):
        with pytest.raises(ValueError, match="typecodes"):
            NarrowColumn(codes)
