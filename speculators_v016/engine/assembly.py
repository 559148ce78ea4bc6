"""Stitch per-step captures into per-request hidden states, exactly.

Every row a worker returns is attributed twice: by the worker (the runner's
own batch order, token offsets and chunk starts) and by the engine (the
scheduler output of that step). Any disagreement is an error, never a guess.
A request is complete when its rows cover positions ``0 .. len(prompt)-1``
contiguously; chunked prefill pieces are stitched in order.

Each captured byte of a prompt is copied once on this side: from the step's states
(usually a view of a ring slot, released right after :meth:`Assembler.add`)
straight into the request's own per-layer tensors, which are what callers get.
A generating request's length is known only at its stop, so its rows are copied
twice: out of each step into a piece, then, once its length is final, into its
tensors (one row per decode step; a growing buffer would copy as much).
Those tensors are fresh memory, or come from ``allocate`` (e.g.
:meth:`~speculators_v016.engine.buffer_pool.BufferPool.take`, whose blocks a
writer gives back once a sample is on disk); with a ``prefault``
(:class:`~speculators_v016.engine.prefault.Prefaulter`) the prompts next in
line get theirs made and touched ahead, on threads of its own. With FP8 storage the step
carries e4m3 codes and one scale per row; both are copied alike (one
allocation holds a request's codes and scales), and callers get one
:class:`~speculators_v016.fp8.Fp8States` per layer. With ``copies``
(:class:`~speculators_v016.engine.row_copies.RowCopies`, GPU engines) the copies of
each step run on a thread of their own while the engine goes on, and a request is handed out
once the copies of its last rows have landed. ``copy_threads`` bounds
torch's intra-op threads for these copies (restored after each step): a copy
split over every core stalls whenever the writers' threads take one of them.

With ``place`` (an in-process worker, :meth:`Assembler.place`) a prompt's rows are
not copied on this side at all: before each step is launched the engine asks
for its placements (the prompt's tensors, allocated then, sliced at the step's
rows) and hands them to the worker, which copies the rows there instead of into
the slot (:mod:`~speculators_v016.worker.row_placement`). The step's capture
then only names them (``StepCapture.placed``); its attribution is checked as
for any step, and a placed set other than the one asked for is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from speculators_v016.config import DEFAULT_COPY_THREADS
from speculators_v016.engine.prefault import Prefaulter
from speculators_v016.engine.row_copies import Pair, RowCopies, torch_threads
from speculators_v016.fp8 import CODE_DTYPE, SCALE_DTYPE, Fp8States
from speculators_v016.protocol import RowPlacement, StepCapture

#: A request's rows of one step: a slot's ``[capture ids, count, hidden]`` view, or (states handed over by
#: reference) one ``[count, hidden]`` tensor per capture id; either way ``rows[j]`` is capture id ``j``'s.
Rows = torch.Tensor | list[torch.Tensor]


class AttributionError(RuntimeError):
    """Captured rows do not match what the scheduler ran: refuse to guess."""


@dataclass
class _Request:
    key: Any
    prompt_len: int  # rows wanted: the prompt's, or a generating request's known tokens
    chunks: dict[int, int] = field(default_factory=dict)  # start -> rows
    rows: int = 0
    out: list[torch.Tensor] | None = None  # one [prompt_len, hidden] per requested layer (FP8: codes)
    scales: list[torch.Tensor] | None = None  # FP8: one [prompt_len] float32 per requested layer
    offered: bool = False  # its tensors were offered to the prefaulter
    generating: bool = False  # rows kept in pieces until its length is final (then ``growing`` is False)
    growing: bool = False  # a generating request whose length is not final yet
    pieces: list | None = None  # a generating request's rows: (start, [layers, n, hidden], FP8 scales or None)
    finite: bool = True  # every step that gave it rows proved them finite on the device (StepCapture.finite)
    placed: bool = False  # its rows go straight to its tensors (Assembler.place): every step's, recomputes too


Allocate = Callable[[Sequence[tuple[Sequence[int], torch.dtype]]], list[torch.Tensor]]


def fresh_tensors(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
    """One new tensor per ``(shape, dtype)``."""
    return [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in specs]


def expected_rows(scheduler_output) -> dict[str, tuple[int, int]]:
    """{request id: (first prompt position, rows)} for one scheduled step."""
    starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return {rid: (starts[rid], n) for rid, n in scheduler_output.num_scheduled_tokens.items()}


def copy_threads(device_type: str) -> int | None:
    """Torch threads for the copies out of the ring slots: bounded on GPU engines, vLLM's own on CPU ones."""
    if device_type == "cpu":  # vLLM's CPU worker bound its threads to cores; its forward shares them
        return None
    return max(1, min(DEFAULT_COPY_THREADS, len(os.sched_getaffinity(0))))


class Assembler:
    """Collects step captures; hands out requests whose states are complete."""

    def __init__(
        self,
        capture_order: tuple[int, ...],
        allocate: Allocate | None = None,
        fp8: bool = False,
        copy_threads: int | None = None,
        prefault: Prefaulter | None = None,
        copies: RowCopies | None = None,
        place: tuple[int, torch.dtype, torch.dtype | None] | None = None,
    ):
        self.capture_order = capture_order  # requested layer j -> row in the captured stack
        self._captured = max(capture_order, default=-1) + 1  # layers a capture holds at least
        self.copies = copies  # runs each step's copies on its own thread (None: on the caller's, in add)
        self.allocate = allocate or fresh_tensors
        self.prefault = prefault  # makes the next prompts' tensors ahead (with this ``allocate``)
        #: hidden, dtype, FP8 scales' dtype (known from the first capture, or given with ``place``)
        self._row: tuple[int, torch.dtype, torch.dtype | None] | None = place
        self.placing = place is not None  # the worker copies prompts' rows into their tensors (place)
        self._placed: dict[int, dict[str, int]] = {}  # step -> {request placed: rows placed}
        self.placed_rows = 0  # rows the worker placed (counted as their steps come)
        self.fp8 = fp8  # captures carry e4m3 codes and scales
        self.copy_threads = copy_threads  # torch threads for the copies (None: as they are)
        self._requests: dict[str, _Request] = {}
        self._expected: dict[int, dict[str, tuple[int, int]]] = {}
        self._complete: list[str] = []
        self._closed: dict[str, int] = {}  # generating requests handed out -> the step then (late rows dropped)
        self.proven: set[str] = set()  # requests handed out whose every row the device proved finite (caller's to take)
        self._last_step = 0

    def add_request(self, req_id: str, key: Any, prompt_len: int, generating: bool = False) -> None:
        """A request whose rows ``0 .. prompt_len - 1`` are wanted; ``generating``: more as it samples
        (:meth:`grow`), its rows kept apart until its length is final."""
        self._requests[req_id] = _Request(
            key, prompt_len, generating=generating, growing=generating, pieces=[] if generating else None
        )

    def grow(self, req_id: str, length: int, final: bool) -> None:
        """A generating request now wants rows ``0 .. length - 1`` (its prompt and the tokens sampled so far);
        ``final``: its sample ends there, and rows past it (the step past the end) are dropped."""
        req = self._requests[req_id]
        if not req.growing or length < req.prompt_len:
            raise AttributionError(f"request {req_id}: cannot grow from {req.prompt_len} to {length} rows")
        req.prompt_len, req.growing = length, not final
        if final and req.rows >= length:
            self._trim(req_id, req)

    def expect(self, step: int, rows: dict[str, tuple[int, int]]) -> None:
        self._expected[step] = rows

    def place(self, step: int, rows: dict[str, tuple[int, int]]) -> dict[str, RowPlacement]:
        """Where the worker copies each prompt's rows of ``step`` (``rows``: :meth:`expect`'s): the prompt's
        tensors, allocated now if they are not yet. A prompt is placed in every step or in none (one whose
        first rows came through the slot stays there), so a recompute's rows land after the ones it replaces.
        Generating requests, and everything without ``place``, go through the slot."""
        if not self.placing:
            return {}
        out = {}
        layers = len(self.capture_order)
        for req_id, (start, count) in rows.items():
            req = self._requests.get(req_id)
            if req is None or req.pieces is not None or (req.rows and not req.placed) or req.rows >= req.prompt_len:
                continue  # never into a prompt already complete: its tensors are handed out next
            keep = min(count, req.prompt_len - start)  # rows past the prompt are decode steps
            if keep <= 0:
                continue
            if req.out is None:
                self._allocate(req_id, req)
            req.placed = True
            scales = req.scales if req.scales is not None else [None] * layers
            out[req_id] = RowPlacement(
                start,
                keep,
                [
                    (j, o[start : start + keep], None if s is None else s[start : start + keep])
                    for o, s, j in zip(req.out, scales, self.capture_order)
                ],
            )
        self._placed[step] = {req_id: where.count for req_id, where in out.items()}
        return out

    @property
    def pending_steps(self) -> int:
        return len(self._expected)

    def add(self, capture: StepCapture, release: Callable[[], None] | None = None) -> None:
        """A step's rows into its requests' tensors. ``release`` gives the step's slot back, exactly once: after
        the copies (with :attr:`copies`, once they have landed: :meth:`land`), or at once when the capture is
        refused. The requests the rows complete are handed out (:meth:`pop_complete`) once their copies are done; a
        generating request's at once (its rows are copied on this thread), so the scheduler ends it as inline."""
        pairs: list[Pair] = []
        try:
            done_before = len(self._complete)
            with torch_threads(self.copy_threads):  # a generating request's pieces are copied in _attribute
                self._attribute(capture, pairs)
                if self.copies is None:
                    for dst, src in pairs:
                        dst.copy_(src)
                    return
            # a generating request's states were copied here, on this thread (_add_piece, _trim): it is handed out
            # at once, as inline, so when the scheduler ends it never depends on the copy thread's pace
            fresh = self._complete[done_before:]
            del self._complete[done_before:]
            self._complete += [r for r in fresh if self._requests[r].generating]
            completes = [r for r in fresh if not self._requests[r].generating]
            self.copies.submit(capture.step, pairs, release, completes)
            release = None  # the copies give it back
        finally:
            if release is not None:
                release()

    def land(self, wait: int = 0) -> None:
        """Collect the steps whose copies are done (their slots go back to the ring): their complete requests
        are :meth:`pop_complete`'s. ``wait``: block for at least that many of the oldest steps."""
        if self.copies is not None and self.copies.pending:
            self._complete += self.copies.landed(wait)

    @property
    def copying(self) -> int:
        """Steps whose copies have not landed yet (each holds its ring slot)."""
        return self.copies.pending if self.copies is not None else 0

    def settle(self) -> None:
        """Wait for every step's copies (their slots all go back, even when one failed)."""
        if self.copies is not None and self.copies.pending:
            self._complete += self.copies.settle()

    def _attribute(self, capture: StepCapture, pairs: list[Pair]) -> None:
        """Check a step's rows against the scheduler's and name their copies (``pairs``: destination, source)."""
        expected = self._expected.pop(capture.step, None)
        placed = self._placed.pop(capture.step, {})
        if expected is None:
            raise AttributionError(f"capture for step {capture.step}, which was not scheduled or came twice")
        got = {r: (s, n) for r, s, n in zip(capture.req_ids, capture.starts, capture.counts)}
        if got != expected:
            raise AttributionError(
                f"step {capture.step}: the runner computed {got} (request: (start, rows)), "
                f"the scheduler scheduled {expected}"
            )
        if sorted(capture.placed or ()) != sorted(placed):
            raise AttributionError(
                f"step {capture.step}: the worker placed the rows of {sorted(capture.placed or ())} in their "
                f"tensors, the engine asked it to place {sorted(placed)}"
            )
        # one [rows, hidden] tensor per captured layer: views of the slot's stack, or the states handed over
        layers = None if capture.states is None else list(capture.states)
        total = sum(capture.counts)
        held = None if layers is None else sorted({t.shape[0] for t in layers})
        if held != [total]:
            shown = held[0] if held and len(held) == 1 else held
            raise AttributionError(f"step {capture.step}: {shown} rows for {total} scheduled tokens")
        if len(layers) < self._captured:
            raise AttributionError(f"step {capture.step}: {len(layers)} captured layers, {self._captured} expected")
        self._check_storage(capture)
        self._last_step = max(self._last_step, capture.step)
        for req_id in [r for r, step in self._closed.items() if step < self._last_step - 8]:
            del self._closed[req_id]  # no step in flight can hold rows of it any more
        stacked = isinstance(capture.states, torch.Tensor)  # a slot's [layers, rows, hidden]: one slice a request
        offset = 0
        for req_id, start, count in zip(capture.req_ids, capture.starts, capture.counts):
            end = offset + count
            rows = capture.states[:, offset:end] if stacked else [t[offset:end] for t in layers]
            if req_id in placed:  # already in its tensors, copied there by the worker
                self._add_placed(req_id, start, count, placed[req_id], capture.finite is True)
            else:
                scales = capture.scales[:, offset:end] if self.fp8 else None
                self._add_rows(req_id, start, rows, scales, pairs, capture.finite is True)
            offset = end
        if self.prefault is not None:
            self._row = (layers[0].shape[1], layers[0].dtype, self.fp8 and capture.scales.dtype or None)
            self._offer_ahead()

    def _specs(self, prompt_len: int, hidden: int, dtype: torch.dtype, scales_dtype: torch.dtype | None) -> list:
        """A prompt's tensors: one ``[prompt_len, hidden]`` per requested layer (FP8: codes, then one scale
        per row each, in one allocation)."""
        layers = len(self.capture_order)
        specs = [((prompt_len, hidden), dtype)] * layers
        return specs if scales_dtype is None else specs + [((prompt_len,), scales_dtype)] * layers

    def _offer_ahead(self) -> None:
        """Offer the prompts next in line (admission order, the scheduler's) until the prefaulter is full."""
        for req_id, req in self._requests.items():
            if req.out is not None or req.pieces is not None or req.offered:
                continue
            if not self.prefault.offer(req_id, self._specs(req.prompt_len, *self._row)):
                return
            req.offered = True

    def _check_storage(self, capture: StepCapture) -> None:
        """The capture holds what this run stores: FP8 codes with one scale per row, or no scales."""
        if not self.fp8:
            if capture.scales is not None:
                raise AttributionError(f"step {capture.step}: FP8 scales in a run that stores the engine's dtype")
            return
        rows = capture.states.shape[:2]
        if (
            capture.states.dtype != CODE_DTYPE
            or capture.scales is None
            or capture.scales.dtype != SCALE_DTYPE
            or tuple(capture.scales.shape) != tuple(rows)
        ):
            got = None if capture.scales is None else (capture.scales.dtype, tuple(capture.scales.shape))
            raise AttributionError(
                f"step {capture.step}: FP8 storage needs {CODE_DTYPE} codes and "
                f"{SCALE_DTYPE} scales {tuple(rows)}; got {capture.states.dtype} and {got}"
            )

    def _add_rows(
        self, req_id: str, start: int, rows: Rows, scales: torch.Tensor | None, pairs: list[Pair], finite: bool = False
    ) -> None:
        """Name the copies of ``rows`` (``rows[j]``: capture id ``j``'s ``[count, hidden]``; FP8: plus ``scales``
        ``[capture ids, count]``) into the request's tensors at ``start`` (a generating request's: copied now);
        ``finite``: the device proved them finite (else the request is not proven)."""
        req = self._requests.get(req_id)
        if req is None:
            if req_id in self._closed:  # a generating request already handed out: a step past its end
                return
            raise AttributionError(f"rows for unknown request {req_id}")
        req.finite = req.finite and finite
        if req.pieces is not None:
            self._add_piece(req_id, req, start, rows, scales)
            return
        keep = max(0, min(rows[0].shape[0], req.prompt_len - start))  # rows past the prompt are decode steps
        if keep == 0:
            return
        if start == 0 and req.chunks:  # preempted and recomputed from the start (no prefix cache)
            req.chunks.clear()
            req.rows = 0
        if start in req.chunks:
            raise AttributionError(f"request {req_id}: positions from {start} captured twice")
        if req.out is None:
            self._allocate(req_id, req, (rows[0].shape[1], rows[0].dtype, None if scales is None else scales.dtype))
        pairs += [(out[start : start + keep], rows[j][:keep]) for out, j in zip(req.out, self.capture_order)]
        if scales is not None:
            pairs += [(out[start : start + keep], scales[j, :keep]) for out, j in zip(req.scales, self.capture_order)]
        self._count(req_id, req, start, keep)

    def _allocate(self, req_id: str, req: _Request, row: tuple | None = None) -> None:
        """The prompt's tensors (``row``: hidden, dtype, FP8 scales' dtype; default the known row)."""
        layers = len(self.capture_order)
        specs = self._specs(req.prompt_len, *(row or self._row))
        tensors = self.prefault.take(req_id, specs) if req.offered else self.allocate(specs)
        fp8 = len(tensors) > layers
        req.out, req.scales = tensors[:layers], (tensors[layers:] if fp8 else None)

    def _add_placed(self, req_id: str, start: int, count: int, placed: int, finite: bool) -> None:
        """Rows the worker copied into the request's tensors (``placed`` of the step's ``count``)."""
        req = self._requests.get(req_id)
        if req is None:  # its tensors were handed out before these rows landed in them
            raise AttributionError(f"rows placed for request {req_id} after its states were handed out")
        req.finite = req.finite and finite
        keep = max(0, min(count, req.prompt_len - start))
        if keep != placed:
            raise AttributionError(f"request {req_id}: {placed} rows placed at {start}, {keep} wanted")
        if start == 0 and req.chunks:  # preempted and recomputed from the start: these rows landed last
            req.chunks.clear()
            req.rows = 0
        if start in req.chunks:
            raise AttributionError(f"request {req_id}: positions from {start} captured twice")
        self.placed_rows += keep
        self._count(req_id, req, start, keep)

    def _count(self, req_id: str, req: _Request, start: int, keep: int) -> None:
        """``keep`` rows at ``start`` are in the request's tensors (or on their way there)."""
        req.chunks[start] = keep
        req.rows += keep
        if req.rows == req.prompt_len:
            self._complete.append(req_id)
        elif req.rows > req.prompt_len:
            raise AttributionError(f"request {req_id}: {req.rows} rows for a {req.prompt_len}-token prompt")

    def _add_piece(self, req_id: str, req: _Request, start: int, rows: Rows, scales) -> None:
        """A generating request's rows, copied out of the step and kept until its length is final."""
        count = rows[0].shape[0]
        if start + count > req.prompt_len and req.growing:
            raise AttributionError(
                f"request {req_id}: rows up to position {start + count - 1} before its token there was "
                f"sampled ({req.prompt_len} known)"
            )
        keep = max(0, min(count, req.prompt_len - start))  # past a final length: the step past the end
        if keep == 0:
            return
        if start == 0 and req.chunks:  # preempted and recomputed from the start
            req.chunks.clear()
            req.pieces.clear()
            req.rows = 0
        if start in req.chunks:
            raise AttributionError(f"request {req_id}: positions from {start} captured twice")
        order = list(self.capture_order)
        picked = torch.stack([rows[j][:keep] for j in order])  # a copy: the piece outlives the step's states
        piece_scales = scales[order, :keep] if scales is not None else None  # indexing with a list copies
        req.pieces.append((start, picked, piece_scales))
        req.chunks[start] = keep
        req.rows += keep
        if not req.growing and req.rows >= req.prompt_len:
            self._trim(req_id, req)

    def _trim(self, req_id: str, req: _Request) -> None:
        """A generating request with every row of its final length: its states in one tensor per layer."""
        if req.rows != req.prompt_len:
            raise AttributionError(f"request {req_id}: {req.rows} rows for a {req.prompt_len}-token sample")
        first = req.pieces[0][1]
        layers, hidden = first.shape[0], first.shape[2]
        specs = [((req.prompt_len, hidden), first.dtype)] * layers
        fp8 = req.pieces[0][2] is not None
        if fp8:
            specs += [((req.prompt_len,), req.pieces[0][2].dtype)] * layers
        tensors = self.allocate(specs)
        req.out, req.scales = tensors[:layers], (tensors[layers:] if fp8 else None)
        for start, rows, scales in req.pieces:
            n = rows.shape[1]
            for j in range(layers):
                req.out[j][start : start + n].copy_(rows[j])
                if fp8:
                    req.scales[j][start : start + n].copy_(scales[j])
        req.pieces = None
        self._complete.append(req_id)

    def pop_complete(self) -> list[tuple[Any, list]]:
        """Requests whose every prompt position is captured: (key, one tensor per requested layer).

        With FP8 storage each layer is an :class:`~speculators_v016.fp8.Fp8States`. The ids of those whose
        every row the device proved finite are added to :attr:`proven` (the caller takes them out).
        """
        self.land()
        done, self._complete = self._complete, []
        out = []
        for req_id in done:
            req = self._requests.pop(req_id)
            if req.generating:
                self._closed[req_id] = self._last_step
            position = 0
            for start in sorted(req.chunks):
                if start != position:
                    raise AttributionError(f"request {req_id}: rows jump from position {position} to {start}")
                position += req.chunks[start]
            states = req.out if req.scales is None else [Fp8States(c, s) for c, s in zip(req.out, req.scales)]
            if req.finite and req.chunks:
                self.proven.add(req_id)
            out.append((req.key, states))
        return out

    def unfinished(self) -> dict[str, tuple[int, int]]:
        """{request id: (rows captured, prompt length)} of requests not yet complete."""
        return {rid: (r.rows, r.prompt_len) for rid, r in self._requests.items()}
