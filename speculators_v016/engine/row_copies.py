"""Each step's row copies, on a thread of their own, in the order the steps came.

Copying a step's rows out of its ring slot into the requests' tensors is the one
host cost that grows with the width: at hidden 7168 with 4 layers (56 KiB a
token) an H200 hands over 9.5 GB/s, and on the engine's thread the copies took
2.6 s of a 6.4 s pass beside its 1.3 s of vLLM's steps
(``tools/benchmarks/gpu_generator.py``, docs/benchmarks/gpu_generator.md). Here
the engine's thread only attributes the rows and names each copy (a destination
view, a source view); :class:`RowCopies` runs them on one thread, with torch's
intra-op threads bounded as before, while the engine goes on scheduling and
launching. A step's slot goes back to the ring, and the requests its rows
completed are handed out, only once its copies are done: the engine's thread
learns that from :meth:`RowCopies.landed` (never from the copy thread), so the
ring and the requests are only ever touched by the engine's thread.

One thread keeps the order: a request spanning steps k and k+1 is complete when
k+1's copies are, and k's were done before them. A failed copy is raised on the
engine's thread when its step is collected, its slot given back first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, source view)


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Torch's intra-op thread count set to ``count`` inside the block and restored after (None: unchanged)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RowCopyError(RuntimeError):
    """A step's rows could not be copied out of its ring slot."""


@dataclass
class _Job:
    step: int
    future: Future
    release: Callable[[], None] | None  # gives the step's slot back (the engine's thread calls it)
    completes: list = field(default_factory=list)  # what the step's rows completed (handed out once landed)


class RowCopies:
    """One thread running each step's copies in order; the engine's thread collects what has landed."""

    def __init__(self, threads: int | None):
        self.threads = threads  # torch's intra-op threads for the copies (None: as they are)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="speculators-row-copies")
        self._jobs: deque[_Job] = deque()
        self.copying = 0.0  # s the copy thread spent copying
        self.waited = 0.0  # s the engine's thread waited for copies (a slot, or the end of a stream)

    def submit(self, step: int, pairs: Sequence[Pair], release: Callable[[], None] | None, completes: list) -> None:
        """Copy ``pairs`` after every step submitted before; then ``release`` and ``completes`` are
        :meth:`landed`'s."""
        future = self._pool.submit(self._copy, pairs)
        self._jobs.append(_Job(step, future, release, completes))

    def _copy(self, pairs: Sequence[Pair]) -> None:
        began = time.perf_counter()
        with torch_threads(self.threads):
            for dst, src in pairs:
                dst.copy_(src)
        self.copying += time.perf_counter() - began

    @property
    def pending(self) -> int:
        """Steps whose copies are not collected yet (each holds its slot)."""
        return len(self._jobs)

    def landed(self, wait: int = 0) -> list:
        """What the steps whose copies are done completed, oldest step first; their slots go back first.
        ``wait``: block until at least that many of the oldest steps have landed."""
        out = []
        error: BaseException | None = None
        while self._jobs and (wait > 0 or self._jobs[0].future.done()):
            job = self._jobs.popleft()
            if not job.future.done():
                began = time.perf_counter()
                try:
                    job.future.exception()
                finally:
                    self.waited += time.perf_counter() - began
            wait -= 1
            if job.release is not None:
                job.release()
            exc = job.future.exception()
            if exc is not None:
                error = error or RowCopyError(f"copying step {job.step}'s rows out of its ring slot failed: {exc}")
                error.__cause__ = error.__cause__ or exc
                continue
            out += job.completes
        if error is not None:
            raise error
        return out

    def settle(self) -> list:
        """Wait for every step's copies; what they completed (slots all given back, even on an error: :meth:`landed`
        collects every step before it raises the first failure)."""
        return self.landed(wait=len(self._jobs))

    def close(self) -> None:
        """Wait for the copies, give their slots back, stop the thread."""
        try:
            self.settle()
        finally:
            self._pool.shutdown(wait=True)
