"""Which of a step's rows go straight to their requests' tensors, and which go to the ring slot.

The engine of a uniprocess executor may hand the capture, with each step, a
:class:`~speculators_v016.protocol.RowPlacement` per request: the request's own
tensors for its rows of that step. Copying the rows there from the device (or
from the CPU forward's states) skips the slot, and so the engine's copy out of
it: at hidden 7168 that copy and the writers shared the host's memory, and it
set the CLI's pace (``docs/benchmarks/gpu_generator.md``).

:func:`split_rows` decides from the worker's own attribution of the step: a
request is placed only where its first row and its rows agree with the
placement; every other row goes to the slot, at the offset it has among the
step's rows, as without placements. The copies then read the same rows of
the same buffers either way, so a placed row and a slot row hold the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from speculators_v016.protocol import RowPlacement

#: One placed request: its first row among the step's rows, and where its rows go.
Segment = tuple[int, RowPlacement]


def split_rows(
    req_ids: Sequence[str],
    starts: Sequence[int],
    bounds: Sequence[int],
    placement: Mapping[str, RowPlacement] | None,
) -> tuple[list[Segment], list[tuple[int, int]], list[str]]:
    """``(segments, ranges, placed)`` of a step: the placed requests' rows, the ``[a, b)`` row ranges left for
    the slot (merged, in order), and the placed requests' ids. ``bounds``: each request's first row among the
    step's rows, then the step's total (the runner's ``query_start_loc``)."""
    total = bounds[-1] if bounds else 0
    if not placement:
        return [], ([(0, total)] if total else []), []
    segments: list[Segment] = []
    ranges: list[tuple[int, int]] = []
    placed: list[str] = []
    for i, req_id in enumerate(req_ids):
        first, end = bounds[i], bounds[i + 1]
        where = placement.get(req_id)
        if where is not None and where.start == starts[i] and 0 < where.count <= end - first:
            segments.append((first, where))
            placed.append(req_id)
            continue
        if ranges and ranges[-1][1] == first:
            ranges[-1] = (ranges[-1][0], end)
        elif end > first:
            ranges.append((first, end))
    return segments, ranges, placed


def destinations(segments: Sequence[Segment], row: int) -> list[tuple[int, int, object, object]]:
    """For captured row ``row``: ``(first, count, destination, scales' destination or None)`` of each placed
    request's layer that is that row (one entry per requested layer)."""
    return [
        (first, where.count, dst, scales) for first, where in segments for j, dst, scales in where.layers if j == row
    ]
