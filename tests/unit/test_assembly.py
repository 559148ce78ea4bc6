"""Per-request stitching of step captures (pure logic, no engine)."""

import os

import pytest
import torch

from speculators_v016.config import DEFAULT_COPY_THREADS
from speculators_v016.engine.assembly import Assembler, AttributionError, copy_threads
from speculators_v016.protocol import RowPlacement, StepCapture
from speculators_v016.worker.row_placement import split_rows


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


def placed_step(asm, step, parts, placement):
    """A worker's reply for ``parts``, having copied each placed request's rows into its tensors (no slot rows)."""
    cap = capture(step, parts)
    offset = 0
    for req_id, _, count in parts:
        where = placement.get(req_id)
        if where is not None:
            for j, dst, _ in where.layers:
                dst.copy_(cap.states[j, offset : offset + where.count])
        offset += count
    cap.placed = list(placement)
    cap.states = torch.full_like(cap.states, float("nan"))  # the slot holds nothing of placed requests
    asm.add(cap)


def test_rows_placed_by_the_worker_are_counted_not_copied():
    """A placed prompt's chunks land in its tensors from the worker; the assembler counts them, reads no slot row."""
    asm = Assembler((1, 0), place=(3, torch.float32, None))
    asm.add_request("a", "A", 5)
    asm.add_request("b", "B", 3)
    asm.expect(1, {"a": (0, 2), "b": (0, 3)})
    first = asm.place(1, {"a": (0, 2), "b": (0, 3)})
    assert sorted(first) == ["a", "b"] and [j for j, _, _ in first["a"].layers] == [1, 0]
    placed_step(asm, 1, [("b", 0, 3), ("a", 0, 2)], first)
    assert [k for k, _ in asm.pop_complete()] == ["B"]
    asm.expect(2, {"a": (2, 4)})  # one decode row past the prompt: not placed
    second = asm.place(2, {"a": (2, 4)})
    assert second["a"].count == 3
    placed_step(asm, 2, [("a", 2, 4)], second)
    [(key, states)] = asm.pop_complete()
    assert key == "A" and asm.placed_rows == 8
    assert states[0][:, 0].tolist() == [1000, 1001, 1002, 1003, 1004]
    assert states[1][:, 0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("reported", [[], ["a", "b"]])
def test_a_placed_set_other_than_the_one_asked_for_is_refused(reported):
    """The worker's reply must name exactly the requests the engine asked it to place."""
    asm = Assembler((0, 1), place=(3, torch.float32, None))
    asm.add_request("a", "A", 2)
    asm.add_request("b", "B", 2)
    asm.expect(1, {"a": (0, 2)})
    asm.place(1, {"a": (0, 2)})
    cap = capture(1, [("a", 0, 2)])
    cap.placed = reported
    with pytest.raises(
        AttributionError, match=r"step 1: the worker placed the rows of .* the engine asked it to place \['a'\]"
    ):
        asm.add(cap)


def test_generating_requests_and_prompts_begun_in_the_slot_are_not_placed():
    """Only prompts placed from their first rows are placed; a generating request's rows go through the slot."""
    asm = Assembler((0, 1), place=(3, torch.float32, None))
    asm.add_request("g", "G", 2, generating=True)
    asm.add_request("p", "P", 4)
    assert asm.place(1, {"g": (0, 2)}) == {}
    asm.expect(1, {"p": (0, 2)})
    asm.add(capture(1, [("p", 0, 2)]))  # its first rows through the slot (a step placed nothing)
    assert asm.place(2, {"p": (2, 2)}) == {}


def test_split_rows_places_only_what_the_worker_attributes_alike():
    """A placement whose start or row count disagrees with the worker's batch leaves those rows to the slot."""
    dst = torch.empty(4, 3)
    placement = {
        "a": RowPlacement(0, 2, [(0, dst[:2], None)]),
        "b": RowPlacement(5, 2, [(0, dst[:2], None)]),  # the worker has b at 4: not placed
        "c": RowPlacement(0, 4, [(0, dst, None)]),  # more rows than the worker has of c: not placed
    }
    segments, ranges, placed = split_rows(["a", "b", "c", "d"], [0, 4, 0, 7], [0, 3, 5, 8, 9], placement)
    assert placed == ["a"] and [first for first, _ in segments] == [0]
    assert ranges == [(3, 9)]  # b, c and d, merged
    assert split_rows(["a"], [0], [0, 3], None) == ([], [(0, 3)], [])


def test_a_worker_attributing_otherwise_is_named_before_what_it_placed():
    """Where the worker's batch differs from the scheduler's (so it placed nothing), the error says so first."""
    asm = Assembler((0, 1), place=(3, torch.float32, None))
    asm.add_request("a", "A", 4)
    asm.expect(1, {"a": (0, 2)})
    asm.place(1, {"a": (0, 2)})
    with pytest.raises(AttributionError, match=r"step 1: the runner computed \{'a': \(0, 3\)\}"):
        asm.add(capture(1, [("a", 0, 3)]))
