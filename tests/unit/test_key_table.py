"""The duplicate check's compact table of first keys (run/key_table.py) against a dict, key by key."""

import random

import numpy as np
import pytest

from speculators_v016.run import key_table
from speculators_v016.run.key_table import KeyTable


def keys(draw: random.Random, count: int) -> list[int]:
    """Distinct int64 keys as Python's hash gives them (never -1), both signs."""
    found: set[int] = set()
    while len(found) < count:
        key = draw.randint(-(2**63), 2**63 - 1)
        if key != -1:
            found.add(key)
    return list(found)


def test_blocks_and_single_keys_read_back_as_a_dict_holds_them(monkeypatch):
    """Blocks added whole and keys set one at a time (settled, merged across levels): every read equals a dict's."""
    monkeypatch.setattr(key_table, "RECENT", 37)  # the dict settles by itself often
    draw = random.Random(5)
    table, reference = KeyTable(), {}
    pool = keys(draw, 20_000)
    at = 0
    while at < len(pool):
        count = draw.randint(1, 700)
        block = pool[at : at + count]
        at += count
        if draw.random() < 0.5:
            values = [draw.randint(-(2**40), 2**40) for _ in block]
            assert not table.contains(block).any()
            table.add(block, values)
            reference.update(zip(block, values, strict=True))
        else:
            for key in block:
                assert key not in table
                table[key] = len(reference)
                reference[key] = len(reference)
            if draw.random() < 0.5:
                table.settle()
    assert len(table) == len(reference)
    assert len(table._keys) <= 8  # levels four times apart: a handful for 20,000 keys
    probes = pool[::7] + keys(random.Random(6), 500)
    assert table.contains(probes).tolist() == [p in reference for p in probes]
    for probe in probes:
        assert table.get(probe) == reference.get(probe)
        assert (probe in table) == (probe in reference)


def test_levels_stay_sorted_and_keep_their_values():
    """After merges each level is sorted and every key keeps its own value."""
    table = KeyTable()
    pool = keys(random.Random(1), 5_000)
    for start in range(0, len(pool), 100):
        block = pool[start : start + 100]
        table.add(block, [k % 1_000_003 for k in block])
    for level, values in zip(table._keys, table._values, strict=True):
        assert np.all(level[1:] > level[:-1])
        assert np.array_equal(values, level % 1_000_003)


def test_the_generation_moves_only_when_the_levels_change(monkeypatch):
    """A reader that asked a block's keys at once can trust them until the generation moves."""
    monkeypatch.setattr(key_table, "RECENT", 3)
    table = KeyTable()
    start = table.generation
    table[10] = 1
    table[11] = 2
    assert table.generation == start and table.is_recent(10)
    table[12] = 3  # the third: the dict settles into a level
    assert table.generation == start + 1 and not table.is_recent(10)
    assert 10 in table and table.get(12) == 3


@pytest.mark.parametrize("extreme", [-(2**63), 2**63 - 1])
def test_the_extremes_of_int64_are_keys_like_any(extreme):
    """The smallest and largest int64 are found, and no neighbour of theirs is."""
    table = KeyTable()
    table.add([extreme, 0], [7, 8])
    assert table.get(extreme) == 7 and table.get(0) == 8
    assert table.contains([extreme, 1, -2]).tolist() == [True, False, False]
