"""Aux states handed over by reference: refused where a step's states lie in memory an earlier step's still use.

An in-process CPU engine (the uniprocess executor) hands each step's aux
states to the engine's thread as they are, with no ring and no copy
(:mod:`~speculators_v016.worker.capture`, ``copy_path: reference``). That is
only right while every step's states are memory of their own until the
engine has copied them out: vLLM's adds and our taps make a new tensor each
forward, but a state taken where a model keeps a buffer across forwards (a
persistent input buffer, a static output) would be overwritten by the next
forward while the engine still reads the previous one, silently. The next
step is launched before the previous one's rows are copied out (two forwards
may run in between with async scheduling), so this is a real hazard.

:class:`HeldStates` keeps a weak reference to each step's hand-over views, and
checks each new step's states against the storage of those still alive (the
engine drops its views once their rows are copied): an overlap is a buffer
reused while held, and the run is refused naming both steps. Memory freed by
an earlier step and given to a later one by the allocator is not an overlap:
its views are gone by then.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch


class ReusedStateError(RuntimeError):
    """A step's aux states lie in memory that an earlier step's states, not yet copied out, still use."""


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class HeldStates:
    """The storage extents of the states handed over and still referenced, by step."""

    def __init__(self) -> None:
        self._held: list[tuple[int, int, weakref.ref, int, int]] = []  # step, layer, view, start, end

    def hand_over(self, step: int, states: Sequence[torch.Tensor]) -> None:
        """Record ``states`` (step ``step``'s views, one per layer); raise :class:`ReusedStateError` where one lies
        in the memory of an earlier step's view still alive."""
        self._held = [held for held in self._held if held[2]() is not None]
        for layer, tensor in enumerate(states):
            start, end = _extent(tensor)
            for earlier, their_layer, _, a, b in self._held:
                if start < b and a < end:
                    raise ReusedStateError(
                        f"step {step}: the aux state of captured layer {layer} lies in the memory of step "
                        f"{earlier}'s layer {their_layer}, which the engine has not copied out yet: the model "
                        "reuses that buffer across forwards, so handing states over by reference would lose "
                        f"step {earlier}'s rows; refused (the multiprocess executor's ring copies each step)"
                    )
        self._held += [(step, layer, weakref.ref(t), *_extent(t)) for layer, t in enumerate(states)]

    def __len__(self) -> int:
        return sum(1 for held in self._held if held[2]() is not None)
