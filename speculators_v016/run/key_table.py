"""The duplicate check's table of first keys: int64 key -> int64 value, about 16 bytes an entry.

While the row index is read (:class:`speculators_v016.run.sources.Duplicates`), every plain row's key (the hash of
its :class:`~speculators_v016.run.row_shape.PlainRow`) is kept with its first row's place until the inputs are
read. A ``dict`` of Python ints held about 115 bytes an entry: 115 MiB at a million rows, the largest part of the
index's peak memory. Here the keys live in sorted numpy levels (each at least four times the next one's size, so
a few levels for millions of rows, merged in linear time as they fill), beside a small ``dict`` of the newest
keys, moved into a level (:meth:`settle`) by a reader after each block of rows, or once it holds :data:`RECENT`:

* :meth:`contains` asks for a whole block's keys at once (one ``searchsorted`` a level); a reader that asked
  it before a block's rows and then sets keys one at a time for them looks a key up whole (``in``) only where
  :attr:`generation` moved since (the levels changed), else in :meth:`is_recent`;
* ``key in table``, ``table.get(key)`` and ``table[key] = value`` serve one row at a time (a key is set once:
  the duplicate check sets only keys it did not find);
* :meth:`add` puts a block's new, distinct keys in one sorted level.

The keys are Python's ``hash`` values (in int64's range; never -1), the values any int64.
"""

from __future__ import annotations

import numpy as np

#: how much larger a level is than the next one, at least, once merged (the levels: log base 4 of the rows)
GROWTH = 4
#: keys set one at a time held in the dict before they move into a level
RECENT = 8192


class KeyTable:
    """int64 keys -> int64 values, with set-like and dict-like reads (see the module's docstring)."""

    def __init__(self):
        self._recent: dict[int, int] = {}
        self._keys: list[np.ndarray] = []  # sorted int64 keys of each level, largest level first
        self._values: list[np.ndarray] = []  # int64 values of each level, in its keys' order
        self.generation = 0  # counts the changes of the levels

    def __len__(self) -> int:
        return len(self._recent) + sum(len(k) for k in self._keys)

    def get(self, key: int, default=None):
        found = self._recent.get(key)
        if found is not None:
            return found
        for keys, values in zip(self._keys, self._values, strict=True):
            i = int(keys.searchsorted(key))
            if i < len(keys) and int(keys[i]) == key:
                return int(values[i])
        return default

    def __contains__(self, key: int) -> bool:
        return self.get(key) is not None

    def __setitem__(self, key: int, value: int) -> None:
        self._recent[key] = value
        if len(self._recent) >= RECENT:
            self.settle()

    def is_recent(self, key: int) -> bool:
        """Was ``key`` set one at a time since the levels last changed?"""
        return key in self._recent

    def contains(self, keys) -> np.ndarray:
        """A bool per key of ``keys`` (a sequence of ints): is it in the table?"""
        wanted = np.asarray(keys, dtype=np.int64)
        found = np.zeros(len(wanted), dtype=bool)
        if self._recent:
            found |= np.fromiter((k in self._recent for k in keys), dtype=bool, count=len(wanted))
        for level in self._keys:
            at = np.minimum(level.searchsorted(wanted), len(level) - 1)
            found |= level[at] == wanted
        return found

    def add(self, keys, values) -> None:
        """Keys not in the table, all distinct (the caller checked: :meth:`contains`), with their values."""
        k = np.asarray(keys, dtype=np.int64)
        if len(k):
            order = np.argsort(k, kind="stable")
            self._push(k[order], np.asarray(values, dtype=np.int64)[order])

    def settle(self) -> None:
        """The keys set one at a time since the last call moved into a sorted level (a reader calls it after each
        block of rows, so the dict stays small)."""
        if self._recent:
            recent, self._recent = self._recent, {}
            self.add(list(recent), list(recent.values()))

    def _push(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.generation += 1
        self._keys.append(keys)
        self._values.append(values)
        while len(self._keys) > 1 and len(self._keys[-2]) < GROWTH * len(self._keys[-1]):
            _merge_last(self._keys, self._values)


def _merge_last(keys: list, values: list) -> None:
    """The last two levels (sorted, no key in common) as one sorted level, in their place (linear: each of the
    last one's keys' place found in the one before). The keys are merged, and the two levels' keys let go of,
    before the values: at most one merged array beside the levels (8 bytes an entry, not 16)."""
    places = keys[-2].searchsorted(keys[-1])
    places += np.arange(len(places))
    rest = np.ones(len(keys[-2]) + len(places), dtype=bool)
    rest[places] = False
    for arrays in (keys, values):
        b, a = arrays.pop(), arrays.pop()
        merged = np.empty(len(rest), dtype=np.int64)
        merged[places], merged[rest] = b, a
        del a, b  # the levels' only references: freed before the next merged array is made
        arrays.append(merged)
