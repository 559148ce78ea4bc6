"""Per-request stitching of step captures (pure logic, no engine)."""

import os

import pytest
import torch

from speculators_v016.config import DEFAULT_COPY_THREADS
from speculators_v016.engine.assembly import Assembler, AttributionError, copy_threads
from speculators_v016.protocol import StepCapture


def rows(start, count, layers=2, hidden=3):
    """``[layers, count, hidden]`` rows whose values encode prompt position + 1000 x captured layer."""
    pos = torch.arange(start, start + count, dtype=torch.float32)
    layer = 1000 * torch.arange(layers, dtype=torch.float32)
    return (layer[:, None, None] + pos[None, :, None]).expand(layers, count, hidden).clone()


def capture(step, parts):
    return StepCapture(
        step,
        [p[0] for p in parts],
        [p[1] for p in parts],
        [p[2] for p in parts],
        states=torch.cat([rows(s, n) for _, s, n in parts], dim=1),
    )


def test_chunks_are_stitched_in_order():
    """Chunked prefill pieces of two requests, in batch order, become whole prompts."""
    asm = Assembler((1, 0))
    asm.add_request("a", "A", 5)
    asm.add_request("b", "B", 3)
    asm.expect(1, {"a": (0, 2), "b": (0, 3)})
    asm.add(capture(1, [("b", 0, 3), ("a", 0, 2)]))
    assert [k for k, _ in asm.pop_complete()] == ["B"]
    asm.expect(2, {"a": (2, 3)})
    asm.add(capture(2, [("a", 2, 3)]))
    [(key, states)] = asm.pop_complete()
    assert key == "A" and len(states) == 2
    assert states[0][:, 0].tolist() == [1000, 1001, 1002, 1003, 1004]  # requested layer 0 = captured row 1
    assert states[1][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert states[0].is_contiguous()


def test_a_request_is_proven_finite_only_where_every_step_of_its_rows_was():
    """A request's NaN/Inf proof: every step that gave it rows proved them (``StepCapture.finite``), else none."""
    asm = Assembler((0, 1))
    for rid, n in (("a", 5), ("b", 3), ("c", 2)):
        asm.add_request(rid, rid.upper(), n)
    asm.expect(1, {"a": (0, 2), "b": (0, 3), "c": (0, 1)})
    first = capture(1, [("a", 0, 2), ("b", 0, 3), ("c", 0, 1)])
    first.finite = True
    asm.add(first)
    asm.expect(2, {"a": (2, 3), "c": (1, 1)})
    second = capture(2, [("a", 2, 3), ("c", 1, 1)])  # not proven: finite None
    asm.add(second)
    assert sorted(k for k, _ in asm.pop_complete()) == ["A", "B", "C"]
    assert asm.proven == {"b"}  # a and c had rows in a step without the proof


def test_disagreement_with_scheduler_is_an_error():
    """A runner row count that differs from the scheduler's raises AttributionError."""
    asm = Assembler((0, 1))
    asm.add_request("a", "A", 5)
    asm.expect(1, {"a": (0, 4)})
    with pytest.raises(AttributionError, match="scheduler scheduled"):
        asm.add(capture(1, [("a", 0, 5)]))


def test_unscheduled_step_is_an_error():
    """A capture for a step that was never scheduled is refused."""
    asm = Assembler((0,))
    with pytest.raises(AttributionError, match="not scheduled"):
        asm.add(capture(7, [("a", 0, 1)]))


def test_recompute_after_preemption_restarts():
    """Rows starting again at position 0 replace what a preempted request had."""
    asm = Assembler((0, 1))
    asm.add_request("a", "A", 4)
    asm.expect(1, {"a": (0, 2)})
    asm.add(capture(1, [("a", 0, 2)]))
    asm.expect(2, {"a": (0, 4)})
    asm.add(capture(2, [("a", 0, 4)]))
    [(_, states)] = asm.pop_complete()
    assert states[1][:, 0].tolist() == [1000, 1001, 1002, 1003]


def test_decode_rows_past_the_prompt_are_dropped():
    """Rows beyond the prompt (a decode step) never enter the states."""
    asm = Assembler((0,))
    asm.add_request("a", "A", 2)
    asm.expect(1, {"a": (0, 2)})
    asm.add(capture(1, [("a", 0, 2)]))
    asm.expect(2, {"a": (2, 1)})
    asm.add(capture(2, [("a", 2, 1)]))
    [(_, states)] = asm.pop_complete()
    assert states[0].shape[0] == 2


def test_rows_are_copied_out_of_the_slot():
    """What add() received can be overwritten at once (the slot is reused): results keep their values."""
    asm = Assembler((0, 1))
    asm.add_request("a", "A", 3)
    asm.expect(1, {"a": (0, 3)})
    step = capture(1, [("a", 0, 3)])
    asm.add(step)
    step.states.fill_(-1.0)
    [(_, states)] = asm.pop_complete()
    assert states[0][:, 0].tolist() == [0, 1, 2] and states[1][:, 0].tolist() == [1000, 1001, 1002]


def test_capture_without_rows_is_an_error():
    """A capture whose states are missing (slot not resolved) is refused, not guessed."""
    asm = Assembler((0,))
    asm.add_request("a", "A", 2)
    asm.expect(1, {"a": (0, 2)})
    with pytest.raises(AttributionError, match="None rows for 2 scheduled tokens"):
        asm.add(StepCapture(1, ["a"], [0], [2], slot=0))


def test_copies_run_with_the_bounded_thread_count_and_restore_it():
    """With copy_threads, the step's copies run on that many torch threads; the count is restored after."""
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    seen = []

    def allocate(specs):  # called inside add(), where the copies happen
        seen.append(torch.get_num_threads())
        return [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in specs]

    asm = Assembler((0, 1), allocate, copy_threads=want)
    asm.add_request("a", "A", 3)
    asm.expect(1, {"a": (0, 3)})
    asm.add(capture(1, [("a", 0, 3)]))
    assert seen == [want] and torch.get_num_threads() == before
    [(_, states)] = asm.pop_complete()
    assert states[1][:, 0].tolist() == [1000, 1001, 1002]
    asm.expect(2, {"b": (0, 2)})  # never added: the copy loop raises, inside the bounded block
    with pytest.raises(AttributionError, match="unknown request b"):
        asm.add(capture(2, [("b", 0, 2)]))
    assert torch.get_num_threads() == before


def test_gpu_engines_bound_copy_threads_cpu_engines_keep_vllms():
    """copy_threads: None on a CPU engine (vLLM's bound threads), at most DEFAULT_COPY_THREADS and the usable CPUs."""
    assert copy_threads("cpu") is None
    assert copy_threads("cuda") == min(DEFAULT_COPY_THREADS, len(os.sched_getaffinity(0)))
