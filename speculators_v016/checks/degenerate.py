"""Hidden states a real model never produces: rows of exact zeros, or one row repeated for different tokens.

Such states come from a broken capture (a ring replaced by an empty file, a
copy that never happened or stopped half way), not from a model: every decoder
layer's output carries its token's embedding and, through attention, its
position. They are also invisible to the NaN/Inf check and to the logit check
when the last layer is not captured. The screen is per row, so a layer with
only some rows zeroed (or copied) is caught like a whole layer: a row counts as
repeated only where another row holds the same values for a different token
(identical tokens may legitimately give identical rows in a model without
positional encoding).

One exception, from what the model computes: a zero row is legitimate where
its token's input embedding row is zero (``zero_ids``,
:mod:`~speculators_v016.checks.zero_embeddings` reads them from the checkpoint):
in a model without biases such a token at position 0 gives exact zeros in
every layer (norm, attention and MLP of 0 are 0), and real checkpoints have
such rows (padding, reserved tokens). That exemption is narrow on purpose: a
zero row of any other token, a zero layer of tokens with non-zero embeddings,
and repeated non-zero rows are still findings. What is lost is only a broken
capture that zeroes exactly the rows of zero-embedding tokens and no other.

Both functions are exact. :func:`may_be_degenerate` reads a few columns of
every row (what a run can afford per sample): a zero row is zero in those
columns, and two equal rows are equal there, so False proves there is nothing
to find. :func:`degenerate_layers` confirms each candidate row on all of its
values and names layer and rows (``verify``, and the run's self-check once the
screen flagged a sample). A run screens each sample on its writer's thread, just
before the writer writes it (:class:`~speculators_v016.checks.self_check.WriterScreen`):
the engine's thread is spared the screen.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from speculators_v016.fp8 import Fp8States

_COLUMNS = 16  # columns of every row the screen reads
_NAMED = 8  # rows named in a finding at most


@functools.lru_cache(maxsize=64)
def _columns(hidden: int) -> torch.Tensor:
    """The screen's columns of a row of ``hidden`` values (made once per width: the screen runs per sample, on the
    engine's thread; making them took 6% of that thread at hidden 7168 on the H200 host). Read, never written."""
    return torch.linspace(0, max(hidden - 1, 0), min(hidden, _COLUMNS)).round().long().unique()


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Odd multipliers of the row hash (fixed, so a run and verify group alike; integer sums wrap exactly).
_MIX = torch.randint(-(2**62), 2**62, (_COLUMNS + 1,), generator=torch.Generator().manual_seed(29)) | 1
_MIX_NP = _MIX.numpy()


def _bits(h: torch.Tensor | Fp8States, rows=slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows' values as integers, FP8 scales as integers or None): equal rows have equal bits."""
    if isinstance(h, Fp8States):
        return h.codes[rows].view(torch.uint8), h.scales[rows].contiguous().view(torch.int32)
    values = h[rows].contiguous()
    return values.view(_INT[values.element_size()]), None


def _zero(h: torch.Tensor | Fp8States, rows=slice(None)) -> torch.Tensor:
    """Per row: every value is +0 or -0 (FP8: every code, whatever the scale)."""
    if isinstance(h, Fp8States):
        return ((h.codes[rows].view(torch.uint8) & 0x7F) == 0).all(dim=-1)
    return (h[rows] == 0).all(dim=-1)


def _screen_bits(h: torch.Tensor | Fp8States) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(a few columns of every row as integers, FP8 scales as integers or None, the bits that are not the sign)."""
    columns = _columns(h.shape[1]).numpy()
    if isinstance(h, Fp8States):
        codes = np.take(h.codes.view(torch.uint8).numpy(), columns, axis=1)
        return codes, _scale_bits(h), _magnitude(1)
    size = h.element_size()
    return np.take(h.view(_INT[size]).numpy(), columns, axis=1), None, _magnitude(size)


def _magnitude(size: int) -> int:
    """The bits of a ``size``-byte float that are not its sign (FP8 e4m3: 0x7F)."""
    return (1 << (8 * size - 1)) - 1


def _scale_bits(h: Fp8States) -> np.ndarray:
    return h.scales.contiguous().view(torch.int32).numpy()


def _candidates(h: torch.Tensor | Fp8States) -> tuple[list[int], list[list[int]]]:
    """(rows that may be zero, groups of rows that may be equal), from a few columns of every row."""
    return _candidates_of(*_screen_bits(h))


def _candidates_of(bits: np.ndarray, scales: np.ndarray | None, magnitude: int) -> tuple[list[int], list[list[int]]]:
    """(rows that may be zero, groups of rows that may be equal), from ``bits``: a few columns of every row.

    Rows are grouped by a hash of those columns' bits (and FP8 scales): equal rows always share a group; a
    collision only adds a candidate, which :func:`_equal_classes` then tells apart. The screen runs on the
    columns' integer bits in numpy: torch's CPU ops on a ``[rows, 16]`` bf16 slice (an elementwise compare, a
    reduction over 16 values) took 7-27 ms a layer through its thread pool (a zero test is a test of the bits
    but the sign).
    """
    zero = np.flatnonzero(((bits & bits.dtype.type(magnitude)) == 0).all(axis=1)).tolist()
    key = (bits.astype(np.int64) * _MIX_NP[: bits.shape[1]]).sum(axis=1)  # integer sums wrap, as intended
    if scales is not None:
        key = key * _MIX_NP[-1] + scales.astype(np.int64)
    order = np.argsort(key, kind="stable")
    ranked = key[order]
    same = ranked[1:] == ranked[:-1]
    if not same.any():
        return zero, []
    bounds = np.flatnonzero(np.concatenate([[True], ~same])).tolist() + [len(ranked)]
    groups = [sorted(order[a:b].tolist()) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
    return zero, groups


def _name(rows: list[int], length: int) -> str:
    shown = ", ".join(map(str, rows[:_NAMED])) + (", ..." if len(rows) > _NAMED else "")
    return f"rows [{shown}] ({len(rows)} of {length})"


def _exempt(ids: torch.Tensor, rows: list[int], zero_ids: frozenset[int]) -> list[int]:
    """``rows`` less those whose token's embedding row is zero (a zero row is what the model computes there)."""
    if not zero_ids or not rows:
        return rows
    return [r for r, t in zip(rows, ids[rows].tolist()) if t not in zero_ids]


def may_be_degenerate(
    input_ids: torch.Tensor, states: Sequence[torch.Tensor | Fp8States], zero_ids: frozenset[int] = frozenset()
) -> bool:
    """Cheap screen (a few columns per row): False proves no row is all zeros (of a token whose embedding row
    is not zero, ``zero_ids``) or repeats another token's."""
    layers = [_screen_bits(h) for h in states if h.shape[0]]
    return not _plainly_distinct(layers) and _flagged(input_ids, layers, zero_ids)


def _plainly_distinct(layers: list) -> bool:
    """True when, in every layer, no row is zero in the screened columns and no two rows agree there: nothing
    to find, decided for all layers at once in a few numpy calls (each call is a trip through the GIL for the
    writer thread that screens, and beside the engine's thread each trip may wait a switch interval: per layer,
    :func:`_candidates_of` made ten). False: :func:`_flagged` looks closer, layer by layer."""
    if not layers or len({(b.shape, b.dtype, m, s is None) for b, s, m in layers}) != 1:
        return not layers
    bits = np.stack([b for b, _, _ in layers])  # [layers, rows, columns]
    if not (bits & bits.dtype.type(layers[0][2])).any(axis=2).all():
        return False  # a row zero in these columns (but its sign)
    key = np.dot(bits, _MIX_NP[: bits.shape[2]])  # int64; integer sums wrap, as intended: equal rows, equal keys
    if layers[0][1] is not None:
        key = key * _MIX_NP[-1] + np.stack([s for _, s, _ in layers])
    key.sort(axis=1)
    return not (key[:, 1:] == key[:, :-1]).any()


def _flagged(input_ids: torch.Tensor, layers, zero_ids: frozenset[int]) -> bool:
    ids = input_ids.reshape(-1)
    for bits, scales, magnitude in layers:
        zero, groups = _candidates_of(bits, scales, magnitude)
        if _exempt(ids, zero, zero_ids) or any(bool((ids[g] != ids[g[0]]).any()) for g in groups):
            return True
    return False


def _equal_classes(h: torch.Tensor | Fp8States, group: list[int]) -> list[list[int]]:
    """The rows of ``group`` split into classes of rows equal in every value (classes of one row left out)."""
    values, scales = _bits(h, rows=group)
    classes, left = [], torch.arange(len(group))
    while len(left) > 1:
        same = (values[left] == values[left[0]]).all(dim=-1)
        if scales is not None:
            same &= scales[left] == scales[left[0]]
        if int(same.sum()) > 1:
            classes.append([group[k] for k in left[same].tolist()])
        left = left[~same]
    return classes


def degenerate_layers(
    input_ids: torch.Tensor, states: Sequence[torch.Tensor | Fp8States], zero_ids: frozenset[int] = frozenset()
) -> list[tuple[int, str]]:
    """``(position in states, what is wrong)`` for each layer holding rows no real model produces;
    ``zero_ids``: tokens whose input embedding row is zero (their zero rows are the model's own)."""
    ids = input_ids.reshape(-1)
    found = []
    for j, h in enumerate(states):
        length = h.shape[0]
        if length == 0:
            continue
        zero, groups = _candidates(h)
        if zero:
            zero = [r for r, z in zip(zero, _zero(h, rows=zero).tolist()) if z]
        zeros = set(zero)  # every zero row, exempt or not, stays out of the repeated-row test
        zero = _exempt(ids, zero, zero_ids)
        if zero and len(zero) == length:
            found.append((j, "every value is 0"))
            continue
        repeated = []
        for group in groups:
            for rows in _equal_classes(h, group):
                if rows[0] not in zeros and bool((ids[rows] != ids[rows[0]]).any()):
                    repeated.append(rows)
        what = []
        if zero:
            what.append(f"{_name(zero, length)} are all 0")
        if len(repeated) == 1 and len(repeated[0]) == length:
            what.append(f"all {length} positions hold the same row, though the tokens differ")
        elif repeated:
            repeated.sort(key=len, reverse=True)
            more = f" (and {len(repeated) - 1} more such groups)" if len(repeated) > 1 else ""
            what.append(f"{_name(repeated[0], length)} hold the same row, though their tokens differ{more}")
        if what:
            found.append((j, "; ".join(what)))
    return found
