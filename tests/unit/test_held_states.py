"""States handed over by reference: memory an earlier step's states still use is refused, freed memory is not."""

import gc

import pytest
import torch

from speculators_v016.worker.held_states import HeldStates, ReusedStateError


def test_a_buffer_reused_while_an_earlier_step_holds_it_is_refused():
    """The same buffer handed over twice while the first view lives: refused, naming both steps and layers."""
    held, buffer = HeldStates(), torch.zeros(16, 4)
    first = [torch.zeros(8, 4), buffer[:8]]
    held.hand_over(1, first)
    with pytest.raises(ReusedStateError, match=r"step 2: the aux state of captured layer 0 lies in the memory of "
                       r"step 1's layer 1, which the engine has not copied out yet"):  # fmt: skip
        held.hand_over(2, [buffer[8:12]])  # another part of the same storage: still the same buffer


def test_memory_freed_by_an_earlier_step_may_be_given_to_a_later_one():
    """Once an earlier step's views are dropped (copied out), a later step may use the same memory."""
    held, buffer = HeldStates(), torch.zeros(16, 4)
    view = buffer[:8]
    held.hand_over(1, [view])
    assert len(held) == 1
    del view
    gc.collect()
    assert len(held) == 0
    held.hand_over(2, [buffer[:8]])  # the allocator's reuse, as after a free: not a finding


def test_fresh_tensors_every_step_and_layers_of_one_step_are_never_findings():
    """New tensors each step pass; two layers of one step sharing a storage are not compared with each other."""
    held, kept = HeldStates(), []
    for step in range(1, 5):
        stack = torch.zeros(3, 8, 4)
        kept.append(list(stack))  # the layers of one step: views of one storage
        held.hand_over(step, kept[-1])
    assert len(held) == 12
